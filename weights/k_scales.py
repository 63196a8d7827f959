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
matrices whose scales do not factor (kt's own quantizer, Q4_0) cost little.

signed (kt.h KT_SCALE_KS): int8 subs, -128..127, for scales that change sign within a block:
Q6_K's w = d*sc*q with int8 sc per 16 weights, llama.cpp scaling each 256 weights' largest to -128."""

import torch

GROUPS = 8              # kt.h KT_SCALE_K_GROUPS
SUB_RANGE = {False: (0, 255), True: (-128, 127)}
LLAMA_CPP_PEAK = {False: 63, True: -128}    # llama.cpp's K-quants: a block's largest sub-scale (Q6_K: -128)
SAMPLE_BLOCKS = 64


def factor(t: torch.Tensor | None, signed: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """t [rows, n_groups] float32 -> (subs uint8 (signed: int8) [rows, n_groups], bases float16
    [rows, n_groups / GROUPS]) with bases (each repeated over its GROUPS groups) * subs == t exactly
    in float32, or None"""
    if t is None or t.dim() != 2 or t.shape[1] % GROUPS or t.dtype != torch.float32:
        return None
    blocks = t.reshape(-1, GROUPS)
    if _search(blocks[::max(1, blocks.shape[0] // SAMPLE_BLOCKS)], signed) is None:
        return None
    found = _search(blocks, signed)
    if found is None:
        return None
    bases, subs = found
    return subs.to(torch.int8 if signed else torch.uint8).reshape(t.shape), bases.half().reshape(t.shape[0], -1)


def expand(subs: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """The float32 values of factor()'s (subs, bases): [rows, n_groups]"""
    return bases.float().repeat_interleave(GROUPS, dim=1) * subs.float()


def _search(blocks: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per block [n, GROUPS] a float32 base and integer subs that give it (0 for a block of zeros),
    trying base = peak value / LLAMA_CPP_PEAK on every block, then on the blocks still open every
    k from the largest sub down; None if a block has none"""
    low, high = SUB_RANGE[signed]
    peak = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))[:, 0]
    bases = peak / LLAMA_CPP_PEAK[signed]
    subs, ok = _try(blocks, bases, low, high)
    zeros = peak == 0
    bases[zeros], subs[zeros] = 0.0, 0.0
    todo = (~(ok | zeros)).nonzero()[:, 0]
    for k in _peak_subs(signed):
        if todo.numel() == 0:
            break
        base = peak[todo] / k
        sub, ok = _try(blocks[todo], base, low, high)
        bases[todo[ok]], subs[todo[ok]] = base[ok], sub[ok]
        todo = todo[~ok]
    return None if todo.numel() else (bases, subs)


def _peak_subs(signed: bool) -> list[int]:
    """The subs a block's peak is tried at: 255..1, or signed -128, then 127..1 (a sub of -k gives
    the same block as k with the base's sign flipped, so only -128 needs trying)"""
    return ([-128] if signed else []) + list(range(SUB_RANGE[signed][1], 0, -1))


def _try(blocks: torch.Tensor, base: torch.Tensor, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the subs blocks / base rounded, per block whether base is exactly a half and those subs,
    integers low..high, give the block exactly)"""
    subs = (blocks / base[:, None]).round()
    exact = ((subs >= low) & (subs <= high) & (subs * base[:, None] == blocks)).all(dim=1)
    return subs, exact & (base.half().float() == base)
