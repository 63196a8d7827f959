import re
from dataclasses import dataclass, field

import torch

from ..errors import ModelError
from ..layers.linear import COMPUTE_DTYPES, Target

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class ModelOptions:
    """device: where attention, norms, embeddings, dense MLPs and shared experts run.
    dtype: their compute dtype (default float32 on the CPU, bfloat16 on a GPU).
    device_experts: per MoE layer index, one flag per routed expert: True = that expert
    lives on `device` and runs in torch; the others run in kt's CPU kernels."""
    device: str = "cpu"
    dtype: torch.dtype | None = None
    device_experts: dict[int, tuple[bool, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _DEVICE.match(self.device):
            raise ModelError(f"device must be 'cpu' or 'cuda[:n]', got {self.device!r}")
        if self.dtype is None:
            object.__setattr__(self, "dtype", torch.float32 if self.device == "cpu" else torch.bfloat16)
        if self.dtype not in COMPUTE_DTYPES:
            raise ModelError(f"compute dtype {self.dtype} unsupported; use float32, bfloat16 or float16")
        masks = {int(k): tuple(bool(b) for b in v) for k, v in (self.device_experts or {}).items()}
        object.__setattr__(self, "device_experts", masks)

    def target(self) -> Target:
        return Target(torch.device(self.device), self.dtype)
