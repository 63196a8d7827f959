import torch
import torch.nn.functional as F

from ..errors import ModelError


class RMSNorm(torch.nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dim, normalised in float32 like
    transformers. weight [D], or [heads, D] for per-head norms over x [..., heads, D].
    In float32, torch's fused rms_norm (one call instead of five; the same values, bit
    for bit, on the CPU); other dtypes round the normalised x before the weight, as
    transformers does."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.shape = (weight.shape[-1],)
        self.fused = weight.dtype == torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype == torch.float32:
            if self.weight.dim() == 1:
                return F.rms_norm(x, self.shape, self.weight, self.eps)
            return F.rms_norm(x, self.shape, None, self.eps) * self.weight
        xf = x.to(torch.float32)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def stack_heads(norms: list[tuple[RMSNorm, int]]) -> RMSNorm:
    """One norm over [..., sum(heads), D] from (per-head norm, heads) blocks, e.g. Qwen3's
    q_norm over the query heads then k_norm over the key heads."""
    if len({norm.eps for norm, _ in norms}) != 1:
        raise ModelError("per-head norms stacked into one need the same eps")
    weight = torch.cat([norm.weight.expand(heads, -1) for norm, heads in norms])
    return RMSNorm(weight.contiguous(), norms[0][0].eps)
