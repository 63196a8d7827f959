import torch
import torch.nn.functional as F

from ..errors import ModelError
from .linear import Linear

ACTIVATIONS = {"silu": F.silu}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ModelError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)): dense feed-forward and shared experts."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, act: str = "silu"):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))
