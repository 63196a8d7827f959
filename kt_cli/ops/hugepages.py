"""Weights moved into transparent huge pages once, in place, at load: the routed experts
(ops.moe) and the dense layers' matrices on the CPU (layers.linear).

The kernel-layout copies of the weights are ordinary heap memory in 4 KB pages, where
streaming reads run slower. On a 2-core Zen 4 guest, a plain 2-thread read of 1 GB ran
27.7 GB/s in 4 KB pages and 35.9 GB/s in huge pages; one MoE layer decoded 1.05-1.10x
faster with its experts collapsed, and the scaled Qwen3-MoE Q4_0 about 1.05x (tg64 median
of 8-10 runs each, 79.5 -> 83.4 tok/s, on a host whose runs spread +-8%). Its dense matrices
(attention, lm_head: ~45% of a decode step's bytes) in huge pages too: 1.01-1.07x more (six
alternating pairs of runs, median ~1.05x).
madvise(MADV_COLLAPSE), Linux 6.1+, makes the kernel copy every 2 MB-aligned piece of a range into a huge page now, under
any THP setting but "never" (~0.45 GB/s on that guest: 6 s for 2.7 GB of experts). A piece
it cannot move (not wholly mapped, no free huge page) stays as it is, and contents never
change, so this is best effort. KT_HUGEPAGES=0 turns it off.
LLM asks once more for every streamed weight after loading's malloc_trim (kt_cli.llm), which
splits the huge pages that freed temporaries shared with the weights (scaled Qwen3-MoE Q4_0:
0.8 of 2.9 GB back in 4 KB pages; the second pass restores them for +50 MB resident, 0.1 s).
"""

import ctypes
import os
import sys
from functools import lru_cache

import torch

from .numa import tensor_spans

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("KT_HUGEPAGES", "1") != "0"


def spans(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The tensors' bytes (numa.tensor_spans) widened to whole huge pages, with overlapping or
    touching ranges joined."""
    joined: list[tuple[int, int]] = []
    for start, end in tensor_spans(tensors):
        start, end = start // HUGE_PAGE * HUGE_PAGE, -(-end // HUGE_PAGE) * HUGE_PAGE
        if joined and start <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(joined[-1][1], end))
        else:
            joined.append((start, end))
    return joined


def collapse(tensors: list[torch.Tensor]) -> None:
    """Asks the kernel for the tensors' memory in huge pages (no-op when disabled)."""
    if not enabled():
        return
    for start, end in spans(tensors):
        _madvise()(start, end - start, MADV_COLLAPSE)


@lru_cache(maxsize=1)
def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise
