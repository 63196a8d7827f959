"""What `kt convert` is asked to do, validated once at construction."""

from dataclasses import dataclass
from pathlib import Path

from ..errors import WeightsError

TARGETS = ("int8", "int4", "bf16", "gguf")
GROUP_SIZES = (32, 64, 128)
GGUF_TYPES = ("q8_0", "q4_0", "q4_1", "f16", "bf16", "f32")
DEFAULT_GROUP = 64
DEFAULT_GGUF_TYPE = "q8_0"


@dataclass(frozen=True)
class ConvertOptions:
    """source: HF model directory or cached repo id. destination: a directory for
    int8/int4/bf16, a .gguf file for gguf. group_size: weights per scale (int8/int4).
    experts_only: quantize only the routed experts, keep the rest BF16 (F16 in GGUF).
    threads: native quantization threads (None = all cores)."""
    source: str
    destination: Path
    to: str
    group_size: int = DEFAULT_GROUP
    gguf_type: str | None = None
    experts_only: bool = False
    symmetric: bool = True
    threads: int | None = None
    resume: bool = False
    force: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "destination", Path(self.destination).expanduser())
        _check(self.to in TARGETS, f"--to must be one of {', '.join(TARGETS)}, got {self.to!r}")
        _check(self.group_size in GROUP_SIZES,
               f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size!r}")
        self._check_gguf_type()
        _check(self.threads is None or (isinstance(self.threads, int) and 1 <= self.threads <= 4096),
               f"--threads must be an integer in 1..4096, got {self.threads!r}")
        _check(str(self.source).strip() != "", "SRC is empty")
        if self.to == "gguf":
            _check(self.destination.suffix == ".gguf",
                   f"{self.destination}: a GGUF destination must be a file name ending in .gguf")

    def _check_gguf_type(self) -> None:
        if self.to != "gguf":
            _check(self.gguf_type is None, "--gguf-type only applies with --to gguf")
            return
        if self.gguf_type is None:
            object.__setattr__(self, "gguf_type", DEFAULT_GGUF_TYPE)
        _check(self.gguf_type in GGUF_TYPES,
               f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {self.gguf_type!r}")

    @property
    def format_name(self) -> str:
        return f"gguf-{self.gguf_type}" if self.to == "gguf" else self.to

    def fingerprint(self) -> dict:
        """What decides the output bytes (threads and resume/force do not)."""
        return {"to": self.to, "group_size": self.group_size, "gguf_type": self.gguf_type,
                "experts_only": self.experts_only, "symmetric": self.symmetric}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise WeightsError(message)
