"""Streaming text (jaxinfer/text/stream.py): the incremental detokenizer and the stop-string matcher
against their plain definitions (decode everything at once; search the whole text)."""

import os

import numpy as np
import pytest

import jaxinfer
from jaxinfer.text.stream import REPLACEMENT, Detokenizer, StopStrings

TEXTS = ["Hello, world! The year 2024 had 366 days.", "naïve café, Straße, ½ + ¼ = ¾",
         "你好，世界！今天天气很好。", "emoji: 👍🏽 🇫🇷 👨‍👩‍👧 ok", "tabs\tand\n\nnewlines   and spaces  ",
         "def f(x):\n    return x ** 2  # squares"]


@pytest.fixture(scope="module")
def tok(golden_dir):
    return jaxinfer.load_tokenizer(os.path.join(golden_dir, "hf_text", "smollm2", "tokenizer.json.xz"))


@pytest.mark.parametrize("seed", range(4))
def test_detokenizer_output_equals_decoding_everything(tok, seed):
    """Fed in random pieces, the emitted text concatenates to decode(all ids); no piece carries half a
    character (U+FFFD) that the whole text does not have."""
    rng = np.random.default_rng(seed)
    for text in TEXTS:
        ids = tok.encode(text)
        d, out, i = Detokenizer(tok.decode), [], 0
        while i < len(ids):
            n = int(rng.integers(1, 4))
            out.append(d.add(ids[i:i + n]))
            i += n
        out.append(d.flush())
        assert "".join(out) == tok.decode(ids) == d.text
        assert not any(REPLACEMENT in piece for piece in out) or REPLACEMENT in text


def test_detokenizer_decodes_a_window_not_the_whole_output(tok):
    """Each token costs the same however long the output grows: decode only ever sees a few tokens."""
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return tok.decode(ids)

    ids = tok.encode(" ".join(TEXTS) * 20)
    d = Detokenizer(decode)
    for t in ids:
        d.add([t])
    d.flush()
    assert d.text == tok.decode(ids) and len(ids) > 500
    assert max(seen) <= 8, max(seen)  # a window of the last few tokens (more only across split characters)


def _first_stop(text, stops):
    """The plain definition: the first position where some stop string ends; its start."""
    for end in range(1, len(text) + 1):
        for s in stops:
            if text[:end].endswith(s):
                return end - len(s)
    return None


def _hold(text, stops):
    """The longest proper prefix of any stop string that ends the text."""
    return max((k for s in stops for k in range(len(s)) if k and text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(30))
def test_stop_strings_match_the_plain_search(seed):
    rng = np.random.default_rng(seed)
    alphabet = "ab" if seed % 2 else "abc"  # small alphabets: overlapping, self-similar stop strings
    stops = ["".join(rng.choice(list(alphabet), int(rng.integers(1, 7)))) for _ in range(int(rng.integers(1, 4)))]
    text = "".join(rng.choice(list(alphabet), 60))
    want = _first_stop(text, stops)
    m, fed, got = StopStrings(stops), "", None
    while len(fed) < len(text):
        piece = text[len(fed):len(fed) + int(rng.integers(1, 5))]
        got = m.feed(piece)
        fed += piece
        if got is not None:
            break
        assert m.hold == _hold(fed, stops), (stops, fed)
    assert got == want, (stops, text)


def test_long_stop_strings_are_found_across_many_pieces():
    """A 256-character stop string (the server's limit) that arrives one character at a time, beside
    near misses: found at the right place, and the held-back text is what could still become it."""
    stop = "xy" * 127 + "zz"
    text = ("xy" * 200 + "q") * 3 + "xy" * 127 + "zz" + "tail"
    m = StopStrings([stop, "never"])
    for i, ch in enumerate(text):
        got = m.feed(ch)
        if got is not None:
            break
    assert got == text.index(stop) and i == text.index(stop) + len(stop) - 1


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(["ok", ""])
