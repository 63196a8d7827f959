"""Linear layers over a stored QMatrix. On the CPU the matrix stays in its stored
format (I8/I4 codes in the layouts the kernels stream fastest, ops.decode_layout) and runs through kt's kernels; on a GPU it is dequantized once
into the compute dtype and runs through torch."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kt_weights.layout import QMatrix

from .. import ops
from ..errors import ModelError

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Target:
    """Where the torch side of a model runs, and in which dtype."""
    device: torch.device
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in COMPUTE_DTYPES:
            raise ModelError(f"compute dtype {self.dtype} unsupported; use float32, bfloat16 or float16")

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype)


# from this many tokens the float32 path runs a GEMM (native/src/kt_internal.h KT_GEMM_MIN_TOKENS)
GEMM_MIN_TOKENS = 16


def dense_acts(m: int) -> str:
    """The activations dense layers give I8/I4 weights for m tokens. Dense layers
    see every token of every layer, and int8 activations flipped near-ties in the
    output (SmolLM2 answered "What is the capital of France?" in French: "The" led
    "L" by 0.08 logits in fp32), so they take int16 in decode (each value within
    1/65534 of its 32-block's largest: integer products, 2-3x fewer instructions
    than converting every weight to float) and float32 from GEMM_MIN_TOKENS tokens,
    where the GEMM reuses each dequantized weight panel. Routed experts keep int8
    activations (kt_cli.ops.moe)."""
    return "int16" if m < GEMM_MIN_TOKENS else "f32"


class Linear(torch.nn.Module):
    def __init__(self, weight: QMatrix, bias: torch.Tensor | None, target: Target):
        super().__init__()
        self.rows, self.cols = weight.rows, weight.cols
        self.target = target
        self.qweight = ops.decode_layout(weight) if target.on_cpu else None
        self.kernel = ops.BoundLinear(ops.pool(), self.qweight) if target.on_cpu else None
        self.weight = None if target.on_cpu else target.put(weight.dequantize())
        self.bias = None if bias is None else target.put(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., cols] -> [..., rows]"""
        if self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.cols)
        if flat.dtype != torch.float32:
            flat = flat.float()
        y = self.kernel(flat.contiguous(), dense_acts(flat.shape[0]))
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.rows)
        return y if self.bias is None else y + self.bias
