import torch
import torch.nn.functional as F

from ..errors import ModelError
from .fused import FusedLinear
from .linear import Linear

ACTIVATIONS = {"silu": F.silu}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ModelError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)): dense feed-forward and shared experts; gate and up
    are one FusedLinear."""

    def __init__(self, gate_up: FusedLinear, down: Linear, act: str = "silu"):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.forward(x)
        return self.down.forward(self.act(gate) * up)
