"""Incremental detokenization and stop strings, one request at a time.

Text streams as tokens arrive, but a token is not a character: a byte-level BPE token may
end in the middle of a multi-byte UTF-8 character (an emoji is often split over two or
three tokens), and a decoder may change the spelling of a token depending on its
neighbours. So, as vLLM does, each step decodes a short window of recent tokens twice,
with and without the new ones (``prefix_offset``, ``read_offset``), streams only the
difference, and holds it back while it ends in U+FFFD (an incomplete character). The
concatenated deltas then equal ``tokenizer.decode(all_ids)``; ``finish`` flushes whatever
is still held.

Stop strings are matched on the text, so across token boundaries. A suffix of the text
that could still become a stop string is held back until the next tokens decide it; a
match ends the output before the stop string, which is never streamed.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas.

    ``tokenizer`` needs only ``decode(ids, skip_special_tokens=...)``.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self._decode = tokenizer.decode
        self._skip_special = skip_special_tokens
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: decoded again each step for context
        self._read_offset = 0  # tokens before this have had their text produced
        self._pending = ""  # text produced but held back (could start a stop string)
        self.stopped: str | None = None  # the stop string that matched, once one has

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the text that can be streamed now ("" if none yet). After a
        stop string matched, returns the text before it and ignores further tokens."""
        if self.stopped is not None:
            return ""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self._prefix_offset:self._read_offset],
                                   skip_special_tokens=self._skip_special)
        new_text = self._decode(self.ids[self._prefix_offset:], skip_special_tokens=self._skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHARACTER):
            return ""  # no new character yet, or the last one is incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return self._release(new_text[len(prefix_text):], final=False)

    def finish(self) -> str:
        """The text still held back, once no more tokens will come (incomplete characters
        as U+FFFD, as a full decode gives them; a partial stop string as plain text)."""
        if self.stopped is not None:
            return ""
        prefix_text = self._decode(self.ids[self._prefix_offset:self._read_offset],
                                   skip_special_tokens=self._skip_special)
        new_text = self._decode(self.ids[self._prefix_offset:], skip_special_tokens=self._skip_special)
        self._prefix_offset = self._read_offset = len(self.ids)
        return self._release(new_text[len(prefix_text):], final=True)

    def _release(self, text: str, final: bool) -> str:
        pending = self._pending + text
        if not self.stop:
            self._pending = ""
            return pending
        # No match can begin in text already streamed: it was held while it could.
        match = min(((pending.find(s), s) for s in self.stop if s in pending), default=None)
        if match is not None:
            self.stopped = match[1]
            self._pending = ""
            return pending[:match[0]]
        hold = 0 if final else self._partial_stop_length(pending)
        self._pending = pending[len(pending) - hold:] if hold else ""
        return pending[:len(pending) - hold]

    def _partial_stop_length(self, text: str) -> int:
        """The length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
