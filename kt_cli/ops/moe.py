"""One MoE layer's routed experts on kt's fused C operator (native/src/moe.c).

The C side borrows every weight tensor, so MoEExperts keeps the QMatrix lists
alive for its own lifetime, and the input/output tensors of a submitted job
until the job has been waited for. Under a NUMA plan (ops/numa.py) the layer's expert
tensors are interleaved over the nodes once, in place, when the layer is built; then they
are moved into huge pages (ops/hugepages.py).
"""

import weakref
from dataclasses import dataclass

import torch

from kt_weights.layout import Format, QMatrix, fits_i6

from . import gate_up, hugepages, numa
from .ffi_args import OpError, check_status, check_tensor, kt_matrix, pointer
from .linear import GEMM_MIN_TOKENS, decode_layout

ACTIVATIONS = {"silu": 0, "swiglu_clamp": 1}
MAX_TOP_K = 4096


class MoEError(OpError):
    pass


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise MoEError(message)


@dataclass(frozen=True)
class MoEShape:
    n_experts: int
    hidden: int
    inter: int


def _validate(gate: list[QMatrix], up: list[QMatrix], down: list[QMatrix]) -> MoEShape:
    _check(len(gate) > 0, "MoE layer needs at least one expert")
    _check(len(gate) == len(up) == len(down),
           f"gate/up/down experts differ in count: {len(gate)}, {len(up)}, {len(down)}")
    inter, hidden = gate[0].rows, gate[0].cols
    for what, mats, shape, first in (("gate", gate, (inter, hidden), gate[0]), ("up", up, (inter, hidden), gate[0]),
                                     ("down", down, (hidden, inter), down[0])):
        for e, m in enumerate(mats):
            _check(isinstance(m, QMatrix), f"{what}[{e}] is not a QMatrix")
            _check((m.rows, m.cols) == shape, f"{what}[{e}] has shape {(m.rows, m.cols)}, expected {shape}")
            _check(m.format == first.format, f"{what}[{e}] has format {m.format.name}, expected {first.format.name} "
                                             "(gate and up share one format, down one of its own)")
    for e, (g, u) in enumerate(zip(gate, up)):
        _check(g.group == u.group, f"gate[{e}] and up[{e}] differ in group: {g.group} vs {u.group}")
    return MoEShape(len(gate), hidden, inter)


def _matrix_array(ffi, mats: list[QMatrix], what: str):
    arr = ffi.new("kt_matrix[]", len(mats))
    for i, m in enumerate(mats):
        arr[i] = kt_matrix(ffi, m, f"{what}[{i}]")[0]
    return arr


class _Native:
    """The kt_moe handle and what it borrows; freed (after any pending job) by a finalizer."""

    def __init__(self, pool, desc, arrays):
        self.pool, self.desc, self.arrays = pool, desc, arrays
        self.lib, self.ffi = pool.kernels.lib, pool.kernels.ffi
        self.handle = self.lib.kt_moe_new(desc)
        self.pending = None

    def sync(self) -> None:
        if self.pending is not None:
            self.pending = None
            check_status(self.lib.kt_moe_sync(self.pool.handle), "kt_moe_sync")

    def release(self) -> None:
        self.sync()
        if self.handle != self.ffi.NULL:
            self.lib.kt_moe_free(self.handle)
            self.handle = self.ffi.NULL


class MoEJob:
    """An asynchronous layer call; wait() returns its output [T, H] f32."""

    def __init__(self, native: _Native, out: torch.Tensor, keep: tuple):
        self._native, self._out, self._keep = native, out, keep

    def wait(self) -> torch.Tensor:
        if self._native.pending is self:
            self._native.sync()
        self._keep = ()
        return self._out


class MoEExperts:
    """Routed experts of one layer: out[t] = sum_k w[t,k] * down_e(act(gate_e x_t) * up_e x_t).
    Quantized experts go to the operator with gate and up in one interleaved matrix;
    interleave=False keeps them apart, True interleaves float experts too (gate_up.wanted); i6=False
    keeps experts whose I8 codes fit 6 bits in I8 (decode_layout)."""

    def __init__(self, gate: list[QMatrix], up: list[QMatrix], down: list[QMatrix],
                 activation: str = "silu", clamp_limit: float = 0.0, alpha: float = 1.0, ops=None,
                 kernel_layouts: bool = True, row8: bool | None = None, interleave: bool | None = None,
                 i6: bool = True):
        _check(activation in ACTIVATIONS, f"unknown activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
        _check(activation != "swiglu_clamp" or clamp_limit > 0,
               f"swiglu_clamp needs clamp_limit > 0, got {clamp_limit}")
        self.shape = _validate(gate, up, down)
        self._pool = (ops if ops is not None else _default_ops()).pool
        # kernel layouts (decode_layout: row8 or tiled): copies of the codes, which decode streams faster;
        # I6 for a projection only where all its experts fit (gate and up must share a format)
        layout = (lambda m, i6: decode_layout(m, self._pool, row8, i6)) if kernel_layouts else (lambda m, i6: m)
        i6_gate_up, i6_down = i6 and all(map(fits_i6, gate + up)), i6 and all(map(fits_i6, down))
        self.interleaved = gate_up.wanted(interleave, gate[0], up[0])
        if self.interleaved:    # (gate_up, down): ops/gate_up.py
            self.weights = ([layout(gate_up.interleave(g, u), i6_gate_up) for g, u in zip(gate, up)],
                            [layout(m, i6_down) for m in down])
        else:                   # (gate, up, down)
            self.weights = tuple([layout(m, i6) for m in mats]
                                 for mats, i6 in ((gate, i6_gate_up), (up, i6_gate_up), (down, i6_down)))
        self.numa_ranges = numa.interleave(self._pool.kernels, self.tensors(), self._pool.numa)
        hugepages.collapse(self.tensors())
        self._native = self._build(activation, clamp_limit, alpha)
        weakref.finalize(self, self._native.release)

    def _build(self, activation: str, clamp_limit: float, alpha: float) -> _Native:
        ffi = self._pool.kernels.ffi
        names = ("gate_up", "down") if self.interleaved else ("gate", "up", "down")
        arrays = [_matrix_array(ffi, mats, what) for mats, what in zip(self.weights, names)]
        desc = ffi.new("kt_moe_desc *")
        desc.n_experts, desc.activation = self.shape.n_experts, ACTIVATIONS[activation]
        desc.hidden, desc.inter = self.shape.hidden, self.shape.inter
        desc.clamp_limit, desc.alpha = clamp_limit, alpha
        for name, array in zip(names, arrays):
            setattr(desc, name, array)
        native = _Native(self._pool, desc, arrays)
        _check(native.handle != ffi.NULL, "the native MoE operator refused this layer's descriptor")
        return native

    @property
    def pool(self):
        """The Pool this layer's experts run on"""
        return self._pool

    @property
    def float_acts_from(self) -> tuple[int | None, int | None]:
        """For (gate and up, down), which may differ in format: the unit size (tokens of one expert,
        at most 128 a unit) from which they meet float32 activations in the GEMM instead of int8
        ones, or None: I8 with groups of at most 32 on the avx2 variant (native/src/acts.c
        kt_acts_expert_kind)"""
        return self._float_acts_from(self.weights[0][0]), self._float_acts_from(self.weights[-1][0])

    def _float_acts_from(self, m: QMatrix) -> int | None:
        if self._pool.kernels.variant != "avx2" or m.format != Format.I8 or m.group > 32 or m.row8:
            return None
        return GEMM_MIN_TOKENS

    def native_handle(self):
        """The kt_moe * (cffi) for native callers (kt_decode_moe), after any pending job; valid
        while this object lives."""
        self._native.sync()
        return self._native.handle

    def dequantized(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's gate [I, H], up [I, H] and down [H, I] in float32, from the matrices the C
        side computes on (the loaded ones are not kept: that would hold the experts twice)"""
        if self.interleaved:
            return (*gate_up.split(self.weights[0][e].dequantize()), self.weights[1][e].dequantize())
        return tuple(mats[e].dequantize() for mats in self.weights)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the C side borrows: codes, scales and mins of gate and up (or gate_up)
        and down"""
        mats = [m for group in self.weights for m in group]
        return [t for m in mats for t in m.tensors()]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] f32, ids [T, K] int32 (< 0: skipped), weights [T, K] f32 -> [T, H] f32."""
        out, args = self._prepare(x, ids, weights)
        self._raise(self._native.lib.kt_moe_forward(*args))
        return out

    def submit(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> MoEJob:
        """Starts the layer on the pool's workers and returns at once."""
        out, args = self._prepare(x, ids, weights)
        self._raise(self._native.lib.kt_moe_submit(*args))
        job = MoEJob(self._native, out, (x, ids, weights))
        self._native.pending = job
        return job

    def _prepare(self, x, ids, weights):
        self._native.sync()
        T, K = self._check_inputs(x, ids, weights)
        out = torch.empty(T, self.shape.hidden, dtype=torch.float32)
        ffi = self._native.ffi
        args = (self._pool.handle, self._native.handle, pointer(ffi, out, "float *"),
                pointer(ffi, x, "const float *"), pointer(ffi, ids, "const int32_t *"),
                pointer(ffi, weights, "const float *"), T, K)
        return out, args

    def _check_inputs(self, x, ids, weights) -> tuple[int, int]:
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2):     # messages formatted only on failure
            raise MoEError(f"MoE ids must be a 2-D tensor [T, K], got {getattr(ids, 'shape', type(ids).__name__)}")
        T, K = ids.shape
        if K > MAX_TOP_K:
            raise MoEError(f"MoE top-k {K} exceeds {MAX_TOP_K}")
        check_tensor(ids, torch.int32, (T, K), "MoE ids")
        check_tensor(weights, torch.float32, (T, K), "MoE weights")
        check_tensor(x, torch.float32, (T, self.shape.hidden), "MoE x")
        return T, K

    def _raise(self, rc: int) -> None:
        if rc == -1:
            raise MoEError(f"MoE expert id out of range: ids must be < {self.shape.n_experts} "
                           "(negative ids are skipped)")
        check_status(rc, "kt_moe")


def _default_ops():
    from . import default
    return default()
