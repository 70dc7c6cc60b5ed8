"""Image decoding and the per-family image processors, against Hugging Face's PIL processors built from
the same settings file: pixel values within 1e-6, grids and token counts equal; and every refusal."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFile
from transformers import Gemma3ImageProcessorPil, Gemma4ImageProcessorPil, Qwen2VLImageProcessorPil
from transformers.image_transforms import convert_to_rgb

from tinymlx.core.images import ImageData
from tinymlx.vision import (
    Gemma3ImageProcessor,
    Gemma4ImageProcessor,
    ImageError,
    ImageLimits,
    QwenImageProcessor,
    decode_image,
    gemma4_position_ids,
    image_processor_for,
)

CLIP = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
HALF = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
QWEN_SETTINGS = {
    "qwen2.5-vl": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                   "merge_size": 2, **CLIP, "image_processor_type": "Qwen2VLImageProcessor"},
    "qwen3-vl": {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, **HALF},
    "small-bounds": {"size": {"longest_edge": 99999, "shortest_edge": 1}, "min_pixels": 40000,
                     "max_pixels": 120000, "patch_size": 16, "resample": 2, **HALF},
    "defaults": {},
}
GEMMA3_SETTINGS = {"size": {"height": 896, "width": 896}, "resample": 2, "rescale_factor": 1 / 255,
                   "do_normalize": True, "do_pan_and_scan": None, "image_seq_length": 256, **HALF}
GEMMA4_SETTINGS = {"patch_size": 16, "max_soft_tokens": 280, "pooling_kernel_size": 3, "resample": 3,
                   "do_normalize": False, "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0]}
SIZES = [(37, 201), (448, 448), (896, 672), (5, 5), (1000, 30), (333, 517)]  # (width, height)


def picture(width: int, height: int, kind: str = "gradient", seed: int = 0) -> Image.Image:
    """A test picture: a colour gradient with drawn text, or noise."""
    if kind == "noise":
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        return Image.fromarray(pixels)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    image = Image.fromarray(pixels.astype(np.uint8))
    ImageDraw.Draw(image).text((2, height // 3), "tinymlx 54", fill=(250, 20, 120))
    return image


def in_modes(image: Image.Image) -> dict[str, Image.Image]:
    rgba = image.convert("RGBA")
    rgba.putalpha(Image.fromarray(np.arange(image.width * image.height, dtype=np.uint8)
                                  .reshape(image.height, image.width)))
    return {"RGB": image, "RGBA": rgba, "L": image.convert("L"), "P": image.convert("P"),
            "JPEG": reopened(image, "JPEG"), "PNG": reopened(rgba, "PNG")}


def reopened(image: Image.Image, fmt: str) -> Image.Image:
    return Image.open(io.BytesIO(encoded(image, fmt)))


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def settings_dir(tmp_path, settings: dict, name: str = "preprocessor_config.json"):
    (tmp_path / name).write_text(json.dumps(settings))
    return tmp_path


# -- Qwen ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(QWEN_SETTINGS))
def test_qwen_matches_hf(tmp_path, name):
    model_dir = settings_dir(tmp_path, QWEN_SETTINGS[name])
    ours, theirs = QwenImageProcessor.from_dir(model_dir), Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    for width, height in SIZES:
        for mode, image in in_modes(picture(width, height, "noise" if width % 2 else "gradient")).items():
            expected = theirs(image, return_tensors="np")
            got = ours(decode_image(image))
            grid = tuple(int(v) for v in expected["image_grid_thw"][0])
            assert got.grid_thw == grid, (name, width, height, mode)
            assert got.pixel_values.dtype == np.float32
            np.testing.assert_allclose(got.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)
            assert got.num_tokens == grid[0] * grid[1] * grid[2] // ours.merge_size**2
            assert got.num_tokens == ours.num_tokens_for(height, width)
            assert grid[1] * grid[2] == theirs.get_number_of_image_patches(height, width)


@pytest.mark.parametrize("cap", [1, 5000, 50000, 200000])
def test_qwen_pixel_cap_matches_hf_and_keeps_a_valid_grid(tmp_path, cap):
    settings = QWEN_SETTINGS["qwen2.5-vl"]
    ours = QwenImageProcessor.from_config(settings)
    theirs = Qwen2VLImageProcessorPil.from_pretrained(settings_dir(tmp_path, settings))
    for width, height in [(896, 672), (37, 201), (1000, 30), (5, 5)]:
        image = picture(width, height)
        got = ours(image, max_pixels=cap)
        _, grid_h, grid_w = got.grid_thw
        assert grid_h % 2 == 0 and grid_w % 2 == 0 and got.num_tokens >= 1
        assert got.pixel_values.shape == (grid_h * grid_w, 3 * 2 * 14 * 14)
        # the cap holds, except where a side is at its floor of one merge window (as in HF's smart_resize)
        assert grid_h * grid_w * 14 * 14 <= cap or min(grid_h, grid_w) == 2
        size = {"shortest_edge": min(ours.min_pixels, cap), "longest_edge": min(cap, ours.max_pixels)}
        expected = theirs(image, size=size, return_tensors="np")
        assert got.grid_thw == tuple(int(v) for v in expected["image_grid_thw"][0])
        np.testing.assert_allclose(got.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)
    assert ours(picture(896, 672), max_pixels=10**9).grid_thw == ours(picture(896, 672)).grid_thw


def test_qwen_refuses_an_aspect_ratio_over_200():
    with pytest.raises(ImageError, match="aspect ratio"):
        QwenImageProcessor()(picture(1000, 4))


# -- Gemma 3 and Gemma 4 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [896, 224])
def test_gemma3_matches_hf(tmp_path, size):
    settings = {**GEMMA3_SETTINGS, "size": {"height": size, "width": size}}
    model_dir = settings_dir(tmp_path, settings)
    model_config = {"model_type": "gemma3", "mm_tokens_per_image": 64}
    (tmp_path / "config.json").write_text(json.dumps(model_config))
    ours, theirs = Gemma3ImageProcessor.from_dir(model_dir), Gemma3ImageProcessorPil.from_pretrained(model_dir)
    assert ours.num_tokens == 64  # config.json's count wins over the processor's image_seq_length
    assert image_processor_for(model_dir, model_config) == ours
    for width, height in SIZES[:4] if size == 896 else SIZES:
        for mode, image in in_modes(picture(width, height, "noise" if width % 2 else "gradient")).items():
            expected = theirs(image, return_tensors="np")["pixel_values"][0]
            got = ours(decode_image(image))
            assert got.grid_thw is None and got.num_tokens == 64
            assert got.pixel_values.shape == (3, size, size) and got.pixel_values.dtype == np.float32
            np.testing.assert_allclose(got.pixel_values, expected, rtol=0, atol=1e-6, err_msg=mode)


@pytest.mark.parametrize("budget", [280, 70])
def test_gemma4_matches_hf(tmp_path, budget):
    model_dir = settings_dir(tmp_path, {"image_processor": {**GEMMA4_SETTINGS, "max_soft_tokens": budget}},
                             "processor_config.json")
    ours, theirs = Gemma4ImageProcessor.from_dir(model_dir), Gemma4ImageProcessorPil.from_pretrained(model_dir)
    assert ours.max_soft_tokens == budget
    for width, height in [*SIZES, (48 * 7, 48 * 5), (3000, 2)]:
        for mode, image in in_modes(picture(width, height, "noise" if width % 2 else "gradient")).items():
            expected = theirs(image, return_tensors="np")
            got = ours(decode_image(image))
            rows = got.pixel_values.shape[0]
            assert got.num_tokens == expected["num_soft_tokens_per_image"][0] == ours.num_tokens_for(height, width)
            assert got.grid_thw[1] * got.grid_thw[2] == rows and rows // 9 == got.num_tokens
            np.testing.assert_allclose(got.pixel_values, expected["pixel_values"][0, :rows], rtol=0, atol=1e-6,
                                       err_msg=f"{width}x{height} {mode}")
            assert not expected["pixel_values"][0, rows:].any()
            np.testing.assert_array_equal(gemma4_position_ids(got.grid_thw), expected["image_position_ids"][0, :rows])
            assert (expected["image_position_ids"][0, rows:] == -1).all()


def test_gemma4_pixel_cap_picks_a_smaller_budget(tmp_path):
    ours = Gemma4ImageProcessor.from_config(GEMMA4_SETTINGS)
    theirs = Gemma4ImageProcessorPil.from_pretrained(settings_dir(tmp_path, GEMMA4_SETTINGS))
    image = picture(896, 672)
    assert ours.soft_token_budget(None) == 280 and ours.soft_token_budget(10**9) == 280
    assert ours.soft_token_budget(140 * 48 * 48) == 140 and ours.soft_token_budget(1) == 70
    got = ours(image, max_pixels=140 * 48 * 48)
    expected = theirs(image, max_soft_tokens=140, return_tensors="np")
    assert got.num_tokens == expected["num_soft_tokens_per_image"][0] <= 140
    np.testing.assert_allclose(got.pixel_values, expected["pixel_values"][0, :got.pixel_values.shape[0]],
                               rtol=0, atol=1e-6)


def test_image_processor_for_picks_by_model_type(tmp_path):
    settings_dir(tmp_path, {**QWEN_SETTINGS["qwen3-vl"], **GEMMA3_SETTINGS, **GEMMA4_SETTINGS})
    for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
        assert isinstance(image_processor_for(tmp_path, {"model_type": model_type}), QwenImageProcessor)
    assert isinstance(image_processor_for(tmp_path, {"model_type": "gemma3"}), Gemma3ImageProcessor)
    assert isinstance(image_processor_for(tmp_path, {"model_type": "gemma4"}), Gemma4ImageProcessor)
    for model_type in ("qwen2", "gemma3_text", "llama", None):
        assert image_processor_for(tmp_path, {"model_type": model_type}) is None
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        image_processor_for(tmp_path / "missing", {"model_type": "qwen3_vl"})


# -- decoding --------------------------------------------------------------------------------------------


def test_every_source_kind_decodes_to_the_same_rgb(tmp_path):
    image = picture(61, 43, "noise")
    for fmt in ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP"):
        data = encoded(image, fmt)
        path = tmp_path / f"picture.{fmt.lower()}"
        path.write_bytes(data)
        url = f"data:image/{fmt.lower()};base64,{base64.b64encode(data).decode()}"
        expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        for source in (data, bytearray(data), path, str(path), url, ImageData(data), Image.open(path)):
            decoded = decode_image(source, ImageLimits(), "messages[0]")
            assert decoded.mode == "RGB" and decoded.size == (61, 43)
            np.testing.assert_array_equal(np.asarray(decoded), expected, err_msg=f"{fmt} {type(source)}")


def test_transparency_is_composited_over_white_as_hf_does():
    for mode, image in in_modes(picture(40, 30)).items():
        expected = convert_to_rgb(image, return_numpy=True)
        np.testing.assert_array_equal(np.asarray(decode_image(image)), expected, err_msg=mode)
    transparent_gif = picture(20, 10).convert("P")
    transparent_gif.info["transparency"] = 0
    np.testing.assert_array_equal(np.asarray(decode_image(encoded(transparent_gif, "GIF"))),
                                  convert_to_rgb(reopened(transparent_gif, "GIF"), return_numpy=True))


def test_gif_first_frame_and_no_exif_rotation():
    frames = [Image.new("RGB", (8, 8), colour) for colour in ("red", "blue")]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(buffer.getvalue()).getpixel((0, 0)) == (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90": HF's processors do not apply it, so neither do we
    buffer = io.BytesIO()
    picture(30, 10).save(buffer, "JPEG", exif=exif)
    assert decode_image(buffer.getvalue()).size == (30, 10)


def png_header_only(width: int, height: int, rows: int = 0) -> bytes:
    """A 1-bit PNG declaring width x height, with `rows` rows of zero pixels (all rows: a valid image)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    pixels = zlib.compress(bytes((width + 7) // 8 + 1) * rows, 9)
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_before_its_pixels_are_decoded(monkeypatch):
    bomb = png_header_only(8000, 8000, rows=8000)  # 64 megapixels: under Pillow's own limit, over ours
    assert len(bomb) < 20_000
    with Image.open(io.BytesIO(bomb)) as valid:
        valid.load()  # a whole image, not a broken one: only its size refuses it
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self))
    with pytest.raises(ImageError, match=r"bomb.png: the image has too many pixels: 8000x8000"):
        decode_image(bomb, ImageLimits(), "bomb.png")
    with pytest.raises(ImageError, match="bomb.png: the image has too many pixels"):
        decode_image(png_header_only(20000, 20000), ImageLimits(), "bomb.png")  # over Pillow's limit too
    assert not loads
    with pytest.raises(ImageError, match="too many pixels: 20x20 = 400, over the limit of 399"):
        decode_image(picture(20, 20), ImageLimits(max_pixels=399), "x")


def refusal_cases(tmp_path) -> list[tuple[object, ImageLimits, str]]:
    png, jpeg = encoded(picture(64, 48, "noise"), "PNG"), encoded(picture(64, 48, "noise"), "JPEG")
    small = ImageLimits(max_bytes=1000)
    b64 = base64.b64encode(png).decode()
    (tmp_path / "folder").mkdir()
    return [
        (png[: len(png) // 2], ImageLimits(), "corrupt or truncated"),
        (jpeg[: len(jpeg) // 2], ImageLimits(), "corrupt or truncated"),
        (encoded(picture(64, 48, "noise"), "GIF")[:-100], ImageLimits(), "corrupt or truncated"),
        (np.random.default_rng(1).bytes(5000), ImageLimits(), "not an image of a known format"),
        (encoded(picture(16, 16), "TIFF"), ImageLimits(), "unsupported image format TIFF"),
        (encoded(picture(16, 16), "ICO"), ImageLimits(), "unsupported image format ICO"),
        (jpeg, ImageLimits(formats=frozenset({"PNG"})), "unsupported image format JPEG"),
        (png, small, f"the image has {len(png)} bytes, over the limit of 1000"),
        (f"data:image/png;base64,{b64}", small, "over the limit of 1000"),
        (tmp_path / "big.png", small, "over the limit of 1000"),
        (b"", ImageLimits(), "the image is empty"),
        ("data:image/png;base64", ImageLimits(), "bad data URL: no ','"),
        (f"data:image/png,{b64}", ImageLimits(), "bad data URL: the data must be base64"),
        (f"data:text/plain;base64,{b64}", ImageLimits(), "bad data URL: media type 'text/plain'"),
        ("data:image/png;base64,iVBO$$$$", ImageLimits(), "bad data URL: the base64 data does not decode"),
        (str(tmp_path / "missing.png"), ImageLimits(), "image file not found"),
        (tmp_path / "folder", ImageLimits(), "is not a file"),
        ("https://example.com/cat.png", ImageLimits(), "remote image URLs are not fetched"),
        (12345, ImageLimits(), "cannot read an image from a int"),
    ]


def test_every_refusal_is_an_image_error_naming_where_and_why(tmp_path):
    (tmp_path / "big.png").write_bytes(encoded(picture(64, 48, "noise"), "PNG"))
    assert not ImageFile.LOAD_TRUNCATED_IMAGES
    for source, limits, cause in refusal_cases(tmp_path):
        with pytest.raises(ImageError) as refused:
            decode_image(source, limits, "messages[2].content[1]")
        assert isinstance(refused.value, ValueError)
        assert str(refused.value).startswith("messages[2].content[1]: "), str(refused.value)
        assert cause in str(refused.value), (cause, str(refused.value))
    with pytest.raises(ImageError, match=r"^request.image: the data is not an image"):
        decode_image(ImageData(b"\x00" * 10, where="request.image"))
