"""Checks and conversions for every argument handed to the native kernels:
tensors are checked for device, dtype, shape and contiguity before their
pointer is taken, and negative status codes become OpError."""

import weakref

import torch

from kt_weights.errors import WeightsError
from kt_weights.layout import QMatrix

from ..errors import KtError

STATUS_NAMES = {-1: "invalid sizes or format", -2: "out of memory",
                -3: "busy: an asynchronous job is still running", -4: "unsupported"}


# scale dtype -> kt.h kt_scale_type (float16, uint8 and int8 only in the row8 layout: QMatrix.validate)
SCALE_TYPES = {torch.float32: 0, torch.float16: 1, torch.uint8: 2, torch.int8: 3}


class OpError(KtError):
    pass


def check(ok: bool, message: str) -> None:
    if not ok:
        raise OpError(message)


def check_status(rc: int, what: str) -> int:
    if rc < 0:
        raise OpError(f"{what} failed: {STATUS_NAMES.get(rc, f'status {rc}')}")
    return rc


def check_tensor(t, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> None:
    """The messages are only formatted on failure: this runs several times per layer
    in decode, where formatting them every time cost ~10 us a call."""
    if not isinstance(t, torch.Tensor):
        raise OpError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise OpError(f"{what} is on {t.device}, expected cpu")
    if t.dtype != dtype:
        raise OpError(f"{what} has dtype {t.dtype}, expected {dtype}")
    if t.shape != tuple(shape):
        raise OpError(f"{what} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_contiguous():
        raise OpError(f"{what} is not contiguous")


def pointer(ffi, t: torch.Tensor, ctype: str):
    """Raw pointer to a checked tensor; the caller keeps `t` alive during the call."""
    return ffi.cast(ctype, t.data_ptr())


def matrix_2d(t, dtype: torch.dtype, what: str) -> tuple[int, int]:
    if not (isinstance(t, torch.Tensor) and t.dim() == 2):
        raise OpError(f"{what} must be a 2-D tensor, got {_shape_of(t)}")
    m, n = t.shape
    if m < 1 or n < 1:
        raise OpError(f"{what} is empty: shape {tuple(t.shape)}")
    check_tensor(t, dtype, t.shape, what)
    return int(m), int(n)


def kt_matrix(ffi, w: QMatrix, what: str = "weight"):
    """A kt_matrix descriptor borrowing w's tensors (keep w alive while it is used).
    Built and validated once per (library, QMatrix); reused while w keeps the same
    format, sizes and tensor objects, so a decode call pays a few identity checks."""
    check(isinstance(w, QMatrix), f"{what} must be a kt_weights QMatrix, got {type(w).__name__}")
    key = (id(ffi), id(w))
    cached = _DESCRIPTORS.get(key)
    fingerprint = _fingerprint(w)
    if cached is not None and cached[0] == fingerprint:
        return cached[1]
    desc = _new_descriptor(ffi, w, what)
    _DESCRIPTORS[key] = (fingerprint, desc)
    weakref.finalize(w, _DESCRIPTORS.pop, key, None)
    return desc


_DESCRIPTORS: dict[tuple[int, int], tuple[tuple, object]] = {}


class _Identity:
    """Compares by object identity, so a fingerprint check never touches tensor data."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return self.obj is other.obj


def _fingerprint(w: QMatrix) -> tuple:
    return (w.format, w.group, w.rows, w.cols, w.tiled, w.row8,
            *(_Identity(t) for t in (w.data, w.scale, w.min, w.scale_base, w.min_base)))


def _new_descriptor(ffi, w: QMatrix, what: str):
    try:
        w.validate()
    except WeightsError as exc:
        raise OpError(f"{what}: {exc}") from None
    for name in ("data", "scale", "min", "scale_base", "min_base"):
        t = getattr(w, name)
        check(t is None or t.device.type == "cpu", f"{what}.{name} is on {t.device if t is not None else ''}, expected cpu")
    desc = ffi.new("kt_matrix *")
    desc.format, desc.group, desc.rows, desc.cols = int(w.format), int(w.group), w.rows, w.cols
    desc.data = pointer(ffi, w.data, "const void *")
    desc.scale = pointer(ffi, w.scale, "const float *") if w.scale is not None else ffi.NULL
    desc.min = pointer(ffi, w.min, "const float *") if w.min is not None else ffi.NULL
    desc.layout = 2 if w.row8 else 1 if w.tiled else 0     # kt.h KT_LAYOUT_ROW8 / TILES / ROWS
    desc.scale_type = SCALE_TYPES.get(w.scale.dtype, 0) if w.scale is not None else 0
    for name in ("scale_base", "min_base"):
        t = getattr(w, name)
        if t is not None:
            setattr(desc, name, pointer(ffi, t, "const uint16_t *"))
    return desc


def _shape_of(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
