"""Incremental detokenization and stop strings with the default model's byte-level BPE
tokenizer: the streamed deltas must add up to ``tokenizer.decode(all_ids)``."""

import random

import pytest

from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.load import load_tokenizer
from shiftjax.serving.engine.detokenizer import REPLACEMENT_CHARACTER, IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀🎉👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, then text again.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Ünïcödé àçcénts, ß, Ω≈ç√∫, and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚.",
    "  leading spaces\n\nnew lines\ttabs  and trailing  ",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def stream(tokenizer, ids, stop=(), chunks=None):
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.push(ids[i:i + size]))
        i += size
    deltas.append(detok.finish())
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHARACTER in d for d in deltas)


def test_multi_byte_characters_really_are_split_over_tokens(tokenizer):
    """The test above would pass trivially if every token decoded to whole characters."""
    ids = tokenizer.encode(TEXTS[1] + TEXTS[2], add_special_tokens=False)
    split = [i for i in ids if REPLACEMENT_CHARACTER in tokenizer.decode([i])]
    assert len(split) >= 5
    deltas, _ = stream(tokenizer, ids)
    assert deltas.count("") >= 3  # steps where an incomplete character was held back


def test_random_chunks_and_random_tokens(tokenizer):
    rng = random.Random(0)
    for _ in range(30):
        if rng.random() < 0.5:
            ids = tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)
        else:  # arbitrary ids: invalid byte sequences, special tokens, anything
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(min(rng.randrange(1, 5), len(ids) - sum(chunks)))
        deltas, _ = stream(tokenizer, ids, chunks=chunks)
        assert "".join(deltas) == tokenizer.decode(ids), ids


def expected_with_stop(full, stop):
    found = [(full.find(s), s) for s in stop if s in full]
    if not found:
        return full, None
    at, s = min(found)
    return full[:at], s


@pytest.mark.parametrize("text,stop", [
    (TEXTS[0], ("world",)),  # inside one or two tokens
    (TEXTS[0], ("o, w",)),  # across token boundaries
    (TEXTS[0], ("lazy dog.",)),  # at the very end
    (TEXTS[0], ("The quick", "quick brown fox")),  # the earliest match wins
    (TEXTS[0], ("jumps over", "fox jump")),  # overlapping stops: the earlier one wins
    (TEXTS[1], ("🎉",)),  # one emoji, split over tokens
    (TEXTS[1], ("\U0001F600\U0001F389",)),
    (TEXTS[2], ("首都",)),
    (TEXTS[2], ("北京是",)),
    ("aaaaab and more", ("aab",)),  # overlapping partial matches
    ("Hello, world!", ("world?",)),  # a partial match that never completes is flushed
    ("Hello, world!", ("!?",)),  # the last character could start a stop string
    ("Hello, world!", ("nothing",)),
])
def test_stop_strings_end_the_text_and_are_not_returned(tokenizer, text, stop):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    expected, matched = expected_with_stop(full, stop)
    deltas, detok = stream(tokenizer, ids, stop=stop)
    assert "".join(deltas) == expected
    assert detok.stopped == matched


def test_text_that_could_start_a_stop_string_is_held_back(tokenizer):
    ids = tokenizer.encode("Hello, world!", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=("world!!",))
    streamed = "".join(detok.push([i]) for i in ids)
    assert streamed == "Hello, " and detok.stopped is None  # "world!" might still become it
    assert detok.finish() == "world!"


def test_random_adversarial_stop_strings(tokenizer):
    rng = random.Random(1)
    for _ in range(60):
        text = rng.choice(TEXTS)
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids)
        stop = []
        for _ in range(rng.randrange(1, 4)):
            start = rng.randrange(len(full))
            piece = full[start:start + rng.randrange(1, 6)]
            # a real substring, or one that diverges in its last character
            stop.append(piece if rng.random() < 0.6 else piece[:-1] + "\x00")
        stop = tuple(s for s in stop if s)
        deltas, detok = stream(tokenizer, ids, stop=stop)
        expected, matched = expected_with_stop(full, stop)
        assert "".join(deltas) == expected, (text, stop)
        assert detok.stopped == matched
