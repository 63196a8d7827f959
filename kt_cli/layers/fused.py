"""Linear layers that read the same input, run as one: their weight rows are
concatenated once at load, so a step makes one kernel call instead of one per
layer (q/k/v projections; gate/up of dense MLPs and shared experts), and the
output is split back with views. Each output row is the same dot product as in
the separate layers, so the results are identical."""

import dataclasses

import torch

from kt_weights.layout import QMatrix

from ..errors import ModelError
from .linear import Linear, Target

_ROW_FIELDS = ("rows", "data", "scale", "min")


def can_concat_rows(mats: list[QMatrix]) -> bool:
    """Whether the matrices share everything but their rows (format, cols, group,
    layout, presence of min), so their rows can be stacked into one matrix."""
    def shared(m: QMatrix) -> tuple:
        fixed = tuple(getattr(m, f.name) for f in dataclasses.fields(m) if f.name not in _ROW_FIELDS)
        return fixed + (m.scale is None, m.min is None, m.data.dtype)
    return len(mats) > 0 and all(shared(m) == shared(mats[0]) for m in mats)


def concat_rows(mats: list[QMatrix]) -> QMatrix:
    """One matrix whose rows are mats[0]'s rows, then mats[1]'s ... (a copy)."""
    if not can_concat_rows(mats):
        raise ModelError("cannot concatenate matrices that differ in format, columns, group or layout")

    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(m, name) for m in mats]
        return None if parts[0] is None else torch.cat(parts, dim=0).contiguous()
    return dataclasses.replace(mats[0], rows=sum(m.rows for m in mats),
                               data=cat("data"), scale=cat("scale"), min=cat("min"))


def _concat_biases(biases: list[torch.Tensor | None], sizes: list[int]) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat([torch.zeros(n) if b is None else b.float() for b, n in zip(biases, sizes)])


class FusedLinear(torch.nn.Module):
    """x [..., cols] -> one output per part [..., rows_i] (views of one buffer when
    the parts could be fused; separate Linear calls otherwise)."""

    def __init__(self, weights: list[QMatrix], biases: list[torch.Tensor | None], target: Target):
        super().__init__()
        self.sizes = [w.rows for w in weights]
        self.fused = can_concat_rows(weights)
        if self.fused:
            self.parts = torch.nn.ModuleList(
                [Linear(concat_rows(weights), _concat_biases(biases, self.sizes), target)])
        else:
            self.parts = torch.nn.ModuleList(Linear(w, b, target) for w, b in zip(weights, biases))
        self.linears = list(self.parts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused:
            return self.linears[0].forward(x).split(self.sizes, dim=-1)
        return tuple(linear.forward(x) for linear in self.linears)

    def forward_joined(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., cols] -> the parts' outputs side by side [..., sum(rows_i)]"""
        if self.fused:
            return self.linears[0].forward(x)
        return torch.cat([linear.forward(x) for linear in self.linears], dim=-1)
