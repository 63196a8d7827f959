import torch

from kt_weights.layout import QMatrix

from .. import ops
from .linear import Target


class Embedding(torch.nn.Module):
    """Token embeddings. On the CPU the table stays in its stored format and only the
    looked-up rows are dequantized, natively (ops.rows) where the table is in the row layout;
    on a GPU it is dequantized once."""

    def __init__(self, table: QMatrix, target: Target):
        super().__init__()
        self.target = target
        self.table = table if target.on_cpu else None
        self.dense = None if target.on_cpu else target.put(table.dequantize())
        self.lookup = None      # the native RowLookup, made on the first lookup

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] int64 -> [N, hidden] in the compute dtype"""
        if self.dense is not None:
            return self.dense[ids.to(self.dense.device)]
        if ids.numel() == 0:
            return torch.empty(0, self.table.cols, dtype=self.target.dtype)
        if self.table.row8:
            return self.table.dequantize_rows(ids.cpu()).to(self.target.dtype)
        if self.lookup is None:
            self.lookup = ops.default().row_lookup(self.table)
        return self.lookup(ids.cpu()).to(self.target.dtype)
