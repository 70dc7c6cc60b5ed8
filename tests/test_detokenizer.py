import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tinymlx.text.detokenizer import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The cat sat on the mat.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "café naïve résumé Übermäßig señor",
    "你好，世界。今天天气很好，我们去公园散步吧。机器学习与自然语言处理。",
    "こんにちは世界、カタカナとひらがな。",
    "emoji 😀🎉👍🚀 and more 😀😀 🎉",
] * 20
SPECIAL = "<|endoftext|>"
ALPHABET = "abcdefghij tho.,\n" + "éüñ" + "你好世界天气很" + "😀🎉🚀" + "ßカ"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    # A small byte-level BPE: few merges, so multi-byte characters split across tokens.
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[SPECIAL]
    )
    t.train_from_iterator(CORPUS, trainer)
    # The texts below are text: special-token text inside them (hypothesis finds SPECIAL in this file)
    # encodes as ordinary tokens, as a model writes it and as tinymlx encodes chat messages.
    t.encode_special_tokens = True
    return t


def stream(tok, ids, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add(i) for i in ids]
    return deltas + [detok.flush()], detok


def first_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Reference: the stop string that completes first in `text` wins; cut the text before it."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, neg_len, s = min(found)
    return text[: end + neg_len], s


def test_multibyte_characters_really_split_across_tokens(tok):
    ids = tok.encode("天气 😀 ñ").ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, max_size=60) | st.text(st.characters(exclude_categories=["Cs"])))
@example(text=SPECIAL)
@example(text=f"a{SPECIAL}b {SPECIAL[:5]}")
def test_deltas_concatenate_to_the_full_decode_without_replacement_chars(tok, text):
    ids = tok.encode(text).ids
    deltas, detok = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text == detok.text
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)
    assert detok.stop_matched is None


def test_prompt_context_does_not_leak_into_the_output(tok):
    prompt, output = tok.encode("你好，世界。").ids, tok.encode(" The 天气 😀 is nice").ids
    deltas, detok = stream(tok, output, prompt_token_ids=prompt)
    assert "".join(deltas) == detok.text == " The 天气 😀 is nice"


def test_prompt_context_keeps_the_first_tokens_leading_space():
    class SentencePieceLike:  # drops the leading space of the first piece, as Llama's decoder does
        pieces = ["\u2581Hello", "\u2581world", "!"]

        def decode(self, ids, skip_special_tokens):
            return "".join(self.pieces[i] for i in ids).replace("\u2581", " ").removeprefix(" ")

    deltas, _ = stream(SentencePieceLike(), [1, 2], prompt_token_ids=[0])
    assert "".join(deltas) == " world!"


def test_window_stays_short_on_long_outputs(tok):
    class Counting:
        def __init__(self):
            self.longest = 0

        def decode(self, ids, skip_special_tokens):
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting()
    ids = tok.encode("今天天气很好 😀🎉 the cat sat on the mat. " * 100).ids
    deltas, _ = stream(counting, ids, prompt_token_ids=ids[:50])
    assert "".join(deltas) == tok.decode(ids)
    assert counting.longest <= 16, "each step should decode a few recent tokens, not the whole output"


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The cat sat on the mat.", ["the"]),  # likely a single token
        ("The cat sat on the mat.", ["t on th"]),  # spans tokens
        ("The cat sat on the mat.", ["at o"]),  # starts mid-token
        ("今天天气很好，我们去公园散步吧。", ["天气很"]),  # multi-byte, spanning tokens
        ("emoji 😀🎉👍🚀 and more", ["🎉👍"]),
        ("The cat sat on the mat.", ["mat", "cat"]),  # the first to complete wins
        ("abcdef", ["bcdef", "cd"]),  # ... even if another one starts earlier
        ("abcdef", ["zzz"]),  # no match: everything comes out at flush
        ("The cat sat on the mat", ["mat."]),  # a partial match at the end is released at flush
    ],
)
def test_stop_strings_truncate_and_never_leak(tok, text, stop):
    ids = tok.encode(text).ids
    deltas, detok = stream(tok, ids, stop=stop)
    want, matched = first_stop(text, stop)
    assert "".join(deltas) == detok.text == want
    assert detok.stop_matched == matched
    for d in deltas:
        assert not any(s in d for s in stop)


def test_text_that_may_start_a_stop_string_is_held_until_flush(tok):
    detok = IncrementalDetokenizer(tok, stop=["world peace"])
    out = "".join(detok.add(i) for i in tok.encode("hello wor").ids)
    assert out == "hello "
    assert detok.text == "hello wor"
    assert detok.flush() == "wor"


def test_nothing_comes_out_after_a_stop_string(tok):
    detok = IncrementalDetokenizer(tok, stop="cat")  # a lone str is one stop string, not three
    out = "".join(detok.add(i) for i in tok.encode("The cat sat").ids)
    assert out == "The " and detok.stop_matched == "cat"
    assert detok.add(tok.encode(" more").ids[0]) == "" and detok.flush() == ""
    assert detok.text == "The "


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), text=st.text(alphabet=ALPHABET, min_size=1, max_size=50))
def test_random_stop_strings(tok, data, text):
    # Stop strings cut from the text itself (so they do match) plus random ones (which mostly don't).
    cuts = data.draw(st.lists(st.tuples(st.integers(0, len(text) - 1), st.integers(1, 6)), max_size=3))
    stops = [text[i : i + n] for i, n in cuts] + data.draw(
        st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=2)
    )
    stops = list(dict.fromkeys(stops))
    deltas, detok = stream(tok, tok.encode(text).ids, stop=stops)
    want, matched = first_stop(text, stops)
    assert "".join(deltas) == detok.text == want
    assert detok.stop_matched == matched
    assert not any("\ufffd" in d for d in deltas)


def test_special_token_text_is_text_but_the_special_token_is_skipped(tok):
    as_text = tok.encode(SPECIAL).ids
    assert tok.token_to_id(SPECIAL) not in as_text
    assert "".join(stream(tok, as_text)[0]) == SPECIAL


def test_skip_special_tokens(tok):
    ids = tok.encode("hi").ids + [tok.token_to_id(SPECIAL)] + tok.encode(" there").ids
    assert "".join(stream(tok, ids)[0]) == "hi there"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == f"hi{SPECIAL} there"


def test_incomplete_bytes_at_the_end_come_out_on_flush(tok):
    ids = tok.encode("ok 天气很好 😀🎉🚀").ids
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, "some prefix should end inside a multi-byte character"
    partial = ids[: cuts[0]]
    deltas, _ = stream(tok, partial)
    assert "\ufffd" not in "".join(deltas[:-1]) and deltas[-1].endswith("\ufffd")
    assert "".join(deltas) == tok.decode(partial)
