"""Incremental detokenization with stop strings: the one place output text is made.

Text grows as tokens arrive, decoded over a short window (not the whole output each time) and
only at complete characters (a trailing U+FFFD means a multi-byte character is still arriving).
With stop strings, the last ``max(len(stop)) - 1`` characters are held back, so no piece of a
stop string is ever handed out; when one appears, the text is cut before it.
"""

from __future__ import annotations

from minengine.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # complete characters decoded so far (cut at a stop string)
        self.emitted = 0  # characters of text already handed out
        self.stopped = False  # a stop string was found
        self._prefix_offset = 0  # the decode window is ids[prefix_offset:]
        self._read_offset = 0  # ids before this are in text

    def add(self, token_ids: list[int]) -> str:
        """Take new output tokens; returns the text that is now safe to hand out."""
        if self.stopped:
            return ""
        self.ids += token_ids
        self._decode(final=False)
        return self._emit(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of the request (incomplete characters included)."""
        if not self.stopped:
            self._decode(final=True)
        return self._emit(final=True)

    def _decode(self, final: bool) -> None:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self._prefix_offset : self._read_offset])
        window = decode(self.ids[self._prefix_offset :])
        if len(window) > len(prefix) and (final or not window.endswith(_INCOMPLETE)):
            self.text += window[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if self.stop:
            cut = min((i for s in self.stop if (i := self.text.find(s, self.emitted)) >= 0), default=-1)
            if cut >= 0:
                self.text, self.stopped = self.text[:cut], True

    def _emit(self, final: bool) -> str:
        limit = len(self.text) if final or self.stopped else len(self.text) - self.hold
        if limit <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted : limit], limit
        return piece
