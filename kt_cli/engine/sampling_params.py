"""How one request wants its tokens chosen and when it wants to stop."""

import math
from dataclasses import dataclass

from ..errors import KtError


class SamplingParamsError(KtError):
    pass


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 or -1, top_p 1 and min_p 0 switch those filters off.
    Penalties follow vLLM/OpenAI: repetition over prompt and generated tokens, presence and
    frequency over generated tokens only."""
    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        object.__setattr__(self, "stop", _as_tuple(self.stop, str, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, int, "stop_token_ids"))
        for problem in self._problems():
            raise SamplingParamsError(f"invalid sampling parameter: {problem}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def _problems(self) -> list[str]:
        checks = [
            (_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (_is_number(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}"),
            (_is_int(self.top_k) and self.top_k >= -1, f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (_is_number(self.repetition_penalty) and self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty!r}"),
            (_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (self.seed is None or _is_int(self.seed), f"seed must be an integer or None, got {self.seed!r}"),
            (all(self.stop), "stop strings must not be empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}"),
        ]
        return [message for ok, message in checks if not ok]


def _as_tuple(value, kind: type, name: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, kind) and not isinstance(value, bool):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise SamplingParamsError(f"invalid sampling parameter: {name} must be a list of {kind.__name__}") from None
    if not all(isinstance(item, kind) and not isinstance(item, bool) for item in items):
        raise SamplingParamsError(f"invalid sampling parameter: {name} must be a list of {kind.__name__}")
    return items


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
