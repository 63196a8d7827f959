"""Python wrappers of the native kernels. Each wrapper checks every size and
dtype against the tensors it is handed before calling C.

API (implemented in this package's modules):
  pool()                                  the process-wide kt_pool (KT_THREADS threads)
  linear(x [m, cols] f32, w: QMatrix, acts="int8") -> [m, rows] f32 (acts: int8 | int16 | f32)
  kernel_layout(w: QMatrix) -> QMatrix    w tiled for the kernels where its shape allows (load time)
  decode_layout(w: QMatrix) -> QMatrix    I4 (I8) in row8 where the kernels take it, else kernel_layout (load time)
  prefill_acts(w: QMatrix) -> str         the activations a dense layer gives w from GEMM_MIN_TOKENS tokens
  int16_until(w: QMatrix) -> int          the token count from which a dense layer stops giving w int16
  BoundLinear(pool, w)(x, acts="int8")    linear() with w's native descriptor built once (per-token layers)
  row_lookup(w: QMatrix)(ids [n] int64)   -> rows of w [n, cols] f32 (row or tiled layout; embeddings)
  quantize(w [rows, cols] f32, fmt, group, symmetric=True) -> QMatrix   (native, all threads)
  quantize_rows_i8(x [rows, n] f32)       -> (q int8 [rows, n], scale f32 [rows])
  membw_read_gbps(n_bytes, repeats)       -> float
  rms_norm(x [..., D] f32, w [D] or [H, D], eps) -> like x   (single-threaded, decode-sized)
  softmax_topk(logits [T, E] f32, k, normalize, counts=None) -> (weights [T, k] f32, ids [T, k] int32)
  paged_attention(q [n, H, D], k_cache [R, Hkv, D], v_cache [R, Hkv, Dv], Contexts, scale) -> [n, H, Dv]
      one query row per token, each over its own paged context (Contexts.of([slots per row]), or
      Contexts.causal(...) for sequences' new rows: decode and prefill)
  rope_(x [n, heads, dim] f32, cos, sin [n, 1, dim], interleaved) -> x rotated in place
  MoEExperts(gate, up, down, activation="silu", clamp_limit=0.0, alpha=1.0)
      .forward(x [T, H] f32, ids [T, K] int32, weights [T, K] f32) -> [T, H] f32
      .submit(x, ids, weights) -> MoEJob;  MoEJob.wait() -> [T, H] f32

The module-level functions run on the default variant (kernels.load()); Ops binds
the same API to one variant, e.g. Ops(kernels.load_variant("avx2")) in tests.
Note: the functions `pool` and `linear` shadow the submodules of the same name
as attributes of this package; import from the submodules with
`from kt_cli.ops.pool import Pool`, never `from kt_cli.ops import pool as module`.
"""

from functools import cached_property, lru_cache

import torch

from kt_weights.layout import Format, QMatrix

from .. import hardware
from ..kernels import Kernels, load
from . import attention as _attention
from . import linear as _linear
from . import membw as _membw
from . import norm as _norm
from . import quant as _quant
from . import rope as _rope
from . import route as _route
from .attention import Contexts
from .ffi_args import OpError
from .linear import BoundLinear, decode_layout, int16_until, kernel_layout, prefill_acts
from .pool import Pool
from .rows import RowLookup


class Ops:
    """The kernel API bound to one loaded variant and one pool of `threads` threads."""

    def __init__(self, kernels: Kernels, threads: int | None = None):
        self.kernels = kernels
        self.threads = threads if threads is not None else hardware.default_threads()

    @cached_property
    def pool(self) -> Pool:
        return Pool(self.kernels, self.threads)

    def linear(self, x: torch.Tensor, w: QMatrix, acts: str = "int8") -> torch.Tensor:
        return _linear.linear(self.pool, x, w, acts)

    def quantize(self, w: torch.Tensor, fmt: Format, group: int, symmetric: bool = True) -> QMatrix:
        return _quant.quantize(self.pool, w, fmt, group, symmetric)

    def row_lookup(self, w: QMatrix) -> RowLookup:
        return RowLookup(self.kernels, w)

    def quantize_rows_i8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _quant.quantize_rows_i8(self.kernels, x)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return _norm.rms_norm(self.kernels, x, w, eps)

    def softmax_topk(self, logits: torch.Tensor, k: int, normalize: bool,
                     counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _route.softmax_topk(self.kernels, logits, k, normalize, counts)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         contexts: Contexts, scale: float) -> torch.Tensor:
        return _attention.paged_attention(self.pool, q, k_cache, v_cache, contexts, scale)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        return _rope.rope_(self.pool, x, cos, sin, interleaved)

    def membw_read_gbps(self, n_bytes: int = _membw.DEFAULT_BYTES,
                        repeats: int = _membw.DEFAULT_REPEATS) -> float:
        return _membw.membw_read_gbps(self.pool, n_bytes, repeats)


@lru_cache(maxsize=1)
def default() -> Ops:
    return Ops(load())


def pool() -> Pool:
    return default().pool


def linear(x: torch.Tensor, w: QMatrix, acts: str = "int8") -> torch.Tensor:
    return default().linear(x, w, acts)


def quantize(w: torch.Tensor, fmt: Format, group: int, symmetric: bool = True) -> QMatrix:
    return default().quantize(w, fmt, group, symmetric)


def quantize_rows_i8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return default().quantize_rows_i8(x)


def membw_read_gbps(n_bytes: int = _membw.DEFAULT_BYTES, repeats: int = _membw.DEFAULT_REPEATS) -> float:
    return default().membw_read_gbps(n_bytes, repeats)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return default().rms_norm(x, w, eps)


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool,
                 counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return default().softmax_topk(logits, k, normalize, counts)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, contexts: Contexts,
                     scale: float) -> torch.Tensor:
    return default().paged_attention(q, k_cache, v_cache, contexts, scale)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return default().rope_(x, cos, sin, interleaved)


__all__ = ["Ops", "OpError", "Pool", "default", "pool", "linear", "quantize", "quantize_rows_i8",
           "membw_read_gbps", "rms_norm", "softmax_topk", "paged_attention", "Contexts", "rope_"]
