"""What `kt chat` is asked to do, checked once at construction."""

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..errors import KtError


class ChatError(KtError):
    pass


INTERACTIVE_TEMPERATURE = 0.8
ONE_SHOT_TEMPERATURE = 0.0


@dataclass(frozen=True)
class ChatOptions:
    """model: GGUF file, model directory or cached HF repo id (None: kt's default model);
    with url, the model name to ask the server for (None: the server's first model).
    url: an OpenAI-compatible server (http://host:port/v1) instead of an in-process model.
    max_tokens None: reply until end of turn or until the context is full.
    prompt: answer this one message, print only the reply and exit.
    temperature None: greedy (0) for one-shot answers, which scripts want reproducible, and
    INTERACTIVE_TEMPERATURE in the interactive chat."""
    model: str | None = None
    url: str | None = None
    system: str | None = None
    temperature: float | None = None
    top_p: float = 0.9
    max_tokens: int | None = None
    seed: int | None = None
    prompt: str | None = None
    threads: int | None = None
    ctx: int | None = None

    def __post_init__(self):
        if self.url is not None:
            object.__setattr__(self, "url", normalize_url(self.url))
        for problem in self._problems():
            raise ChatError(problem)

    def _problems(self) -> list[str]:
        local_only = [name for name in ("threads", "ctx") if getattr(self, name) is not None]
        checks = [
            (self.temperature is None or (_is_number(self.temperature) and self.temperature >= 0),
             f"--temperature must be a number >= 0, got {self.temperature!r}"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p!r}"),
            (self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             f"--max-tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.seed is None or _is_int(self.seed), f"--seed must be an integer, got {self.seed!r}"),
            (self.threads is None or (_is_int(self.threads) and self.threads >= 1),
             f"--threads must be an integer >= 1, got {self.threads!r}"),
            (self.ctx is None or (_is_int(self.ctx) and self.ctx >= 2),
             f"--ctx must be an integer >= 2, got {self.ctx!r}"),
            (self.prompt is None or bool(self.prompt.strip()), "--prompt is empty"),
            (self.url is None or not local_only,
             f"--{'/--'.join(local_only)} set the in-process model; the server at --url has its own"),
        ]
        return [message for ok, message in checks if not ok]


def normalize_url(url: str) -> str:
    """http://host:port and http://host:port/v1/ both become http://host:port/v1."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ChatError(f"--url must look like http://host:port/v1, got {url!r}")
    path = parts.path.rstrip("/") or "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
