"""Streaming text: token ids arrive a few at a time; text goes out once it is final.

`Detokenizer` decodes only what is new: a window of the last few tokens is decoded and the text
it adds beyond the window's older part is emitted (the way vLLM and text-generation-inference
detokenize), so each token costs the same however long the output grows. Text that ends in an
incomplete UTF-8 character (U+FFFD from a token that holds half a character) is held back until
the next token completes it. The concatenated output equals `tokenizer.decode(all ids)`.

`StopStrings` finds stop strings in text that arrives in pieces, looking only at the new text:
each stop string has a Knuth-Morris-Pratt automaton whose state is the length of the longest
prefix of the stop string that ends the text so far. A state equal to the string's length is a
match; the largest state over all strings is how much text to hold back (it may still become a
stop string). Work per new character is constant per stop string, so long stop strings cost
what they are long once, not for every token.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental decoding of one token stream with `decode(ids) -> str`."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # tokens before this are already in `text`
        self.text = ""  # final text so far

    def add(self, ids: Sequence[int]) -> str:
        """Append new token ids; returns the text that became final (possibly "")."""
        self.ids.extend(int(i) for i in ids)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            new = after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """The text still held back (an unfinished character becomes U+FFFD), at the end of the stream."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        new = after[len(before):]
        self._prefix = self._read = len(self.ids)
        self.text += new
        return new


def _failure(s: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of s[:i + 1]."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopStrings:
    """Finds the first occurrence of any stop string in text fed piece by piece."""

    def __init__(self, stops: Sequence[str]):
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.stops = tuple(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self._seen = 0  # characters fed so far

    def feed(self, text: str) -> Optional[int]:
        """Feed new text. Returns the index (in all text fed so far) where the first stop string
        that completes starts, or None."""
        for j, ch in enumerate(text):
            for i, s in enumerate(self.stops):
                k, fail = self._state[i], self._fail[i]
                while k and ch != s[k]:
                    k = fail[k - 1]
                if ch == s[k]:
                    k += 1
                if k == len(s):
                    return self._seen + j + 1 - k
                self._state[i] = k
        self._seen += len(text)
        return None

    @property
    def hold(self) -> int:
        """Characters at the end of the text fed so far that may still start a stop string."""
        return max(self._state, default=0)
