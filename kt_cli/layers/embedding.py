import torch

from kt_weights.layout import QMatrix

from .linear import Target


class Embedding(torch.nn.Module):
    """Token embeddings. On the CPU the table stays in its stored format and only the
    looked-up rows are dequantized; on a GPU it is dequantized once."""

    def __init__(self, table: QMatrix, target: Target):
        super().__init__()
        self.target = target
        self.table = table if target.on_cpu else None
        self.dense = None if target.on_cpu else target.put(table.dequantize())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] int64 -> [N, hidden] in the compute dtype"""
        if self.dense is not None:
            return self.dense[ids.to(self.dense.device)]
        if ids.numel() == 0:
            return torch.empty(0, self.table.cols, dtype=self.target.dtype)
        return self.table.dequantize_rows(ids.cpu()).to(self.target.dtype)
