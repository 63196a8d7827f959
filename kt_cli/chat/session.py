"""One chat turn, whatever the backend: send the conversation, stream the reply to a writer,
time it, and keep the conversation as the user saw it."""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .backend import Backend, ReplyEnd, Sampling
from .conversation import Conversation


@dataclass(frozen=True)
class ReplyStats:
    """tokens: generated tokens (counted from the stream when the server reports none).
    tokens_per_s: decode speed, first token to last."""
    text: str
    finish_reason: str
    tokens: int
    prompt_tokens: int | None
    ttft_s: float | None
    seconds: float
    context_full: bool

    @property
    def tokens_per_s(self) -> float | None:
        if self.ttft_s is None or self.tokens < 2 or self.seconds <= self.ttft_s:
            return None
        return (self.tokens - 1) / (self.seconds - self.ttft_s)

    def summary(self) -> str:
        parts = [f"{self.tokens} tokens"]
        if self.ttft_s is not None:
            parts.append(f"first token {self.ttft_s:.2f} s")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tok/s")
        if self.finish_reason == "abort":
            parts.append("stopped")
        elif self.context_full:
            parts.append("context full")
        elif self.finish_reason == "length":
            parts.append("max tokens reached")
        return " · ".join(parts)


@dataclass
class Totals:
    replies: int = 0
    tokens: int = 0
    decode_seconds: float = 0.0
    last_prompt_tokens: int | None = None

    def add(self, stats: ReplyStats) -> None:
        self.replies += 1
        self.tokens += stats.tokens
        if stats.ttft_s is not None:
            self.decode_seconds += stats.seconds - stats.ttft_s
        if stats.prompt_tokens is not None:
            self.last_prompt_tokens = stats.prompt_tokens + stats.tokens


@dataclass
class ChatSession:
    backend: Backend
    conversation: Conversation
    sampling: Sampling
    totals: Totals = field(default_factory=Totals)

    def reply(self, user_text: str, write: Callable[[str], None], cancel: threading.Event) -> ReplyStats:
        """Raises BackendError (conversation unchanged) when the reply cannot be made."""
        messages = self.conversation.messages() + [{"role": "user", "content": user_text}]
        stats = _stream_reply(self.backend, messages, self.sampling, write, cancel)
        if stats.text or stats.finish_reason != "abort":
            self.conversation.add("user", user_text)
            self.conversation.add("assistant", stats.text)
        self.totals.add(stats)
        return stats


def _stream_reply(backend: Backend, messages: list[dict], sampling: Sampling,
                  write: Callable[[str], None], cancel: threading.Event) -> ReplyStats:
    start = time.perf_counter()
    first, pieces, end, chunks = None, [], None, 0
    for chunk in backend.stream(messages, sampling, cancel):
        if chunk.text:
            first = first if first is not None else time.perf_counter() - start
            pieces.append(chunk.text)
            chunks += 1
            write(chunk.text)
        end = chunk.end or end
    end = end or ReplyEnd("abort", None, None)
    tokens = end.completion_tokens if end.completion_tokens is not None else chunks
    return ReplyStats("".join(pieces), end.finish_reason, tokens, end.prompt_tokens, first,
                      time.perf_counter() - start, end.context_full)
