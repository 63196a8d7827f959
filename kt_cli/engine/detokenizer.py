"""Token ids -> text, one token at a time, for streaming.

Text is released only when it is stable: never half of a multi-byte character (the
decoder shows an unfinished byte sequence as U+FFFD), and never a tail that might still
grow into a stop string. A few prompt tokens are decoded in front of the output so that
tokenizers which drop a leading space at the start of a decode keep it.
"""

from typing import Protocol

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TextStream:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> bool:
        """Add a generated token; True when the text now contains a stop string (the text is
        then cut just before it)."""
        self.ids.append(token_id)
        self._append(self._stable_delta(final=False))
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out that is safe to hand out now (everything when final)."""
        if final and not self.stopped:
            self._append(self._stable_delta(final=True))
        limit = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        limit = max(limit, self.emitted)
        out, self.emitted = self.text[self.emitted:limit], limit
        return out

    def _stable_delta(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]

    def _append(self, new_text: str) -> None:
        if not new_text or self.stopped:
            return
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += new_text
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
