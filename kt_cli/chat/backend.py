"""The one interface the chat UI talks to; local.py (in-process engine) and remote.py
(OpenAI-compatible HTTP server) implement it.

  Backend.stream(messages, Sampling, cancel) -> Chunk(text) ... Chunk(end=ReplyEnd)

The UI sets `cancel` (a threading.Event) to stop a reply; the backend then ends the
stream with finish_reason "abort" once the engine or server has let the request go."""

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from .options import ChatError


class BackendError(ChatError):
    """The model or server cannot serve this reply; the session may go on."""


class ContextOverflow(BackendError):
    """The conversation no longer fits the model's context."""


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int | None
    seed: int | None


@dataclass(frozen=True)
class ReplyEnd:
    """finish_reason: "stop" (end of turn), "length" (max tokens or context full), "abort".
    Token counts are None when the server does not report them."""
    finish_reason: str
    prompt_tokens: int | None
    completion_tokens: int | None
    context_full: bool = False


@dataclass(frozen=True)
class Chunk:
    text: str = ""
    end: ReplyEnd | None = None


class Backend(Protocol):
    model_name: str
    where: str
    ctx: int | None

    def stream(self, messages: list[dict], sampling: Sampling,
               cancel: threading.Event) -> Iterator[Chunk]: ...

    def close(self) -> None: ...
