"""Two-level scales (kt.h KT_SCALE_K) for the row8 layout: a matrix's float32 scale (or min)
[rows, n_groups] as uint8 subs times one float16 base per row and GROUPS groups, found where
every value factors so exactly. GGUF's K-quants store theirs so: Q4_K and Q5_K hold
w = d*sc*q - dmin*m per sub-block of 32, d and dmin halves per 256 weights, sc and m 6-bit.
A Q4_K matrix then streams 4.625 bits a weight instead of 6 (float32 scale and min).

The factors are searched, not carried from the file, so every path that reorders rows
(gate/up interleave, q/k permutation, fused q/k/v) keeps plain float32 scales. Per block of
GROUPS values with peak p (its value of largest magnitude), base = p / k for some k in
1..255: llama.cpp scales each block's largest sub-block to 63, so k = 63 settles nearly every
block at once; the rest are searched over every k. A sample of blocks is searched first, so
matrices whose scales do not factor (kt's own quantizer, Q4_0) cost little."""

import torch

GROUPS = 8              # kt.h KT_SCALE_K_GROUPS
SUB_MAX = 255
LLAMA_CPP_PEAK = 63     # llama.cpp's K-quants: the largest 6-bit sub-scale of a block
SAMPLE_BLOCKS = 64


def factor(t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """t [rows, n_groups] float32 -> (subs uint8 [rows, n_groups], bases float16 [rows, n_groups / GROUPS])
    with bases (each repeated over its GROUPS groups) * subs == t exactly in float32, or None"""
    if t is None or t.dim() != 2 or t.shape[1] % GROUPS or t.dtype != torch.float32:
        return None
    blocks = t.reshape(-1, GROUPS)
    if _search(blocks[::max(1, blocks.shape[0] // SAMPLE_BLOCKS)]) is None:
        return None
    found = _search(blocks)
    if found is None:
        return None
    bases, subs = found
    return subs.to(torch.uint8).reshape(t.shape), bases.half().reshape(t.shape[0], -1)


def expand(subs: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """The float32 values of factor()'s (subs, bases): [rows, n_groups]"""
    return bases.float().repeat_interleave(GROUPS, dim=1) * subs.float()


def _search(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per block [n, GROUPS] a float32 base and integer subs that give it (0 for a block of zeros),
    trying base = peak value / LLAMA_CPP_PEAK on every block, then on the blocks still open every
    k from SUB_MAX down; None if a block has none"""
    peak = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))[:, 0]
    bases = peak / LLAMA_CPP_PEAK
    subs, ok = _try(blocks, bases)
    zeros = peak == 0
    bases[zeros], subs[zeros] = 0.0, 0.0
    todo = (~(ok | zeros)).nonzero()[:, 0]
    for k in range(SUB_MAX, 0, -1):
        if todo.numel() == 0:
            break
        base = peak[todo] / k
        sub, ok = _try(blocks[todo], base)
        bases[todo[ok]], subs[todo[ok]] = base[ok], sub[ok]
        todo = todo[~ok]
    return None if todo.numel() else (bases, subs)


def _try(blocks: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the subs blocks / base rounded, per block whether base is exactly a half and those subs,
    integers 0..SUB_MAX, give the block exactly)"""
    subs = (blocks / base[:, None]).round()
    exact = ((subs >= 0) & (subs <= SUB_MAX) & (subs * base[:, None] == blocks)).all(dim=1)
    return subs, exact & (base.half().float() == base)
