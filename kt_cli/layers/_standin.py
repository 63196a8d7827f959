"""Torch stand-in for kt_cli.ops.MoEExperts, with the same signature, used until
the native wrapper lands. Delete this file then."""

import torch
import torch.nn.functional as F

from kt_weights.layout import QMatrix


def linear(x: torch.Tensor, w: QMatrix) -> torch.Tensor:
    return x @ w.dequantize().T


class MoEJob:
    def __init__(self, out: torch.Tensor):
        self.out = out

    def wait(self) -> torch.Tensor:
        return self.out


class MoEExperts:
    def __init__(self, gate: list[QMatrix], up: list[QMatrix], down: list[QMatrix], activation: str = "silu"):
        self.gate, self.up, self.down = gate, up, down

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            if e < 0:
                continue
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            xe = x[tok]
            h = F.silu(linear(xe, self.gate[e])) * linear(xe, self.up[e])
            out.index_add_(0, tok, linear(h, self.down[e]) * weights[tok, slot, None])
        return out

    def submit(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> MoEJob:
        return MoEJob(self.forward(x, ids, weights))
