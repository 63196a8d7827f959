"""FP8 e4m3 weights with block scales (DeepSeek-V3 style): w = fp8 * scale_inv,
one float scale per (block_rows x block_cols) tile; the last tiles of a matrix
whose size is not a multiple of the block are partial."""

import math

import torch

from .errors import WeightsError

DEFAULT_BLOCK = (128, 128)


def block_size_from_config(config: dict) -> tuple[int, int]:
    quant = config.get("quantization_config") or {}
    block = quant.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise WeightsError(f"config.json: quantization_config.weight_block_size {block!r} "
                           "is not two positive integers")
    return int(block[0]), int(block[1])


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight (..., R, C) fp8, scale_inv (..., ceil(R/br), ceil(C/bc)) -> (..., R, C) dtype."""
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise WeightsError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} "
                           f"for weight {tuple(weight.shape)} with block {list(block)}")
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def dequantize_fp8_channels(weight: torch.Tensor, scale: torch.Tensor,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight (..., R, C) fp8, scale per output row (..., R) or (..., R, 1), or one
    scalar for the whole tensor -> (..., R, C) dtype."""
    rows = weight.shape[-2]
    if scale.numel() == 1:
        return (weight.float() * scale.float().reshape(())).to(dtype)
    if tuple(scale.shape) not in ((*weight.shape[:-2], rows), (*weight.shape[:-2], rows, 1)):
        raise WeightsError(f"weight_scale has shape {tuple(scale.shape)}, expected one per row "
                           f"{(*weight.shape[:-2], rows, 1)} for weight {tuple(weight.shape)}")
    return (weight.float() * scale.float().reshape(*weight.shape[:-2], rows, 1)).to(dtype)
