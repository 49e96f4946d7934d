"""Incremental detokenization and stop-string search, shared by every backend and CLI."""

from __future__ import annotations


class Detokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences.

    Decodes only a short window (from the last emitted boundary), so each step costs O(new tokens), and the
    window's left context keeps tokenizers that merge spaces across tokens correct.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # ids before this index are already in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self.tokenizer is None:
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Everything not yet emitted (also an incomplete trailing character)."""
        if self.tokenizer is None or self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        delta = self._decode(self.ids[self._prefix:])[len(before):]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, stop_strings: list[str], start: int) -> tuple[int, int]:
    """(index, end) of the earliest stop string that ends after `start` (only new matches), or (-1, -1)."""
    best = (-1, -1)
    for s in stop_strings:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best[0] == -1 or i < best[0]):
            best = (i, i + len(s))
    return best


def held_back(text: str, strings: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `strings`: the characters a stream
    holds back because they may still become one of them (text that can no longer match goes out at once)."""
    if not text:
        return 0
    best, last = 0, text[-1]
    for s in strings:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s[n - 1] == last and text.endswith(s[:n]):
                best = n
                break
    return best
