from dataclasses import dataclass
from pathlib import Path

from .errors import PlacementError
from .strategies import STRATEGIES


@dataclass(frozen=True)
class PlacementOptions:
    """Which routed experts live on the device, and whether they move while serving.

    gpu_experts: per MoE layer; gpu_experts_ratio: of all routed experts (0..1); both None:
    automatic (what free device memory holds after KV cache and activations; 0 without a GPU).
    strategy: uniform | frequency | front-loading | random (frequency needs expert_stats).
    record_expert_stats: a .json or .safetensors file the routed-token counts are written to.
    prefill_replace_tokens: a forward of at least this many tokens re-places each layer's
    device experts on that batch's routing (None: off). decode_replace_tokens: after this
    many smaller-batch tokens, swap up to decode_replace_moves experts per layer from the
    running counts, uploading in a background thread (None: off)."""
    gpu_experts: int | None = None
    gpu_experts_ratio: float | None = None
    strategy: str = "uniform"
    expert_stats: Path | None = None
    seed: int = 0
    record_expert_stats: Path | None = None
    record_interval_s: float = 30.0
    prefill_replace_tokens: int | None = None
    decode_replace_tokens: int | None = None
    decode_replace_moves: int = 1

    def __post_init__(self) -> None:
        for name in ("expert_stats", "record_expert_stats"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value).expanduser())
        for problem in self._problems():
            raise PlacementError(problem)

    def _problems(self) -> list[str]:
        checks = [
            (self.strategy in STRATEGIES, f"unknown placement {self.strategy!r}; choose one of {', '.join(STRATEGIES)}"),
            (self.strategy != "frequency" or self.expert_stats is not None,
             "frequency placement needs expert statistics (--expert-stats FILE, from --record-expert-stats)"),
            (self.gpu_experts is None or self.gpu_experts_ratio is None,
             "give --gpu-experts or --gpu-experts-ratio, not both"),
            (self.gpu_experts is None or _int_at_least(self.gpu_experts, 0),
             f"--gpu-experts must be an integer >= 0, got {self.gpu_experts!r}"),
            (self.gpu_experts_ratio is None or _ratio(self.gpu_experts_ratio),
             f"--gpu-experts-ratio must be a number in 0..1, got {self.gpu_experts_ratio!r}"),
            (_int_at_least(self.seed, 0), f"placement seed must be an integer >= 0, got {self.seed!r}"),
            (self.prefill_replace_tokens is None or _int_at_least(self.prefill_replace_tokens, 1),
             f"prefill re-placement threshold must be an integer >= 1, got {self.prefill_replace_tokens!r}"),
            (self.decode_replace_tokens is None or _int_at_least(self.decode_replace_tokens, 1),
             f"decode re-placement interval must be an integer >= 1, got {self.decode_replace_tokens!r}"),
            (_int_at_least(self.decode_replace_moves, 1),
             f"decode re-placement moves must be an integer >= 1, got {self.decode_replace_moves!r}"),
            (isinstance(self.record_interval_s, (int, float)) and self.record_interval_s > 0,
             f"record interval must be > 0 seconds, got {self.record_interval_s!r}"),
        ]
        return [message for ok, message in checks if not ok]

    @property
    def dynamic(self) -> bool:
        return self.prefill_replace_tokens is not None or self.decode_replace_tokens is not None


def _int_at_least(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _ratio(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0
