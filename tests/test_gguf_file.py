"""read_gguf against gguf-py's GGUFReader: the same metadata values and tensors, for every value type."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tinymlx.loader.gguf_file import read_gguf

VT = gguf.GGUFValueType


def _every_kind_gguf(path: Path, alignment: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, kind in [("u8", 200, VT.UINT8), ("i8", -100, VT.INT8), ("u16", 60_000, VT.UINT16),
                             ("i16", -30_000, VT.INT16), ("u32", 4_000_000_000, VT.UINT32),
                             ("i32", -2_000_000_000, VT.INT32), ("f32", 0.1, VT.FLOAT32), ("yes", True, VT.BOOL),
                             ("no", False, VT.BOOL), ("u64", 1 << 60, VT.UINT64), ("i64", -(1 << 60), VT.INT64),
                             ("f64", 0.1, VT.FLOAT64), ("text", "héllo ▁ 世界", VT.STRING), ("empty", "", VT.STRING)]:
        writer.add_key_value(f"test.{key}", value, kind)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, 1e-6, -3.25])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.no_items", [])
    writer.add_token_list(["a", "Ġb", "<|im_start|>", "", "✓"] * 50)
    writer.add_token_scores([float(i) for i in range(250)])
    writer.add_tensor("f32", rng.standard_normal((3, 64), np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    writer.add_tensor("vector", rng.standard_normal(7, np.float32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("q8", gguf.quants.quantize(rng.standard_normal((4, 64), np.float32), q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_read_gguf_reads_what_gguf_py_reads(tmp_path, alignment):
    path = _every_kind_gguf(tmp_path / "kinds.gguf", alignment)
    reference, ours = gguf.GGUFReader(path), read_gguf(path)
    expected = {key: field.contents() for key, field in reference.fields.items()}
    assert list(ours.metadata) == list(expected)  # the same keys in the same order, GGUF.* included
    for key, value in expected.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in ours.metadata[key]] == [type(v) for v in value], key
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for theirs, mine in zip(reference.tensors, ours.tensors):
        assert mine.tensor_type == theirs.tensor_type and mine.shape == tuple(int(d) for d in theirs.shape)
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (theirs.n_elements, theirs.n_bytes,
                                                                     theirs.data_offset)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


@pytest.mark.parametrize("keep", [3, 30, 200, -64], ids=["magic", "header", "metadata", "tensor-data"])
def test_a_cut_file_is_refused(tmp_path, keep):
    whole = _every_kind_gguf(tmp_path / "kinds.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    with pytest.raises(Exception) as error:
        read_gguf(cut)
    assert not isinstance(error.value, (AssertionError, MemoryError))
    if keep == -64:  # past the padding after the last tensor, into its bytes
        assert "its tensors need" in str(error.value)
