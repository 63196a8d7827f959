"""Rotary position embeddings: plain, linear, llama3 and YaRN frequency schedules
(the same maths as transformers' modeling_rope_utils), applied in either layout:
halves (Llama/Qwen: x[i] pairs with x[i + dim/2]) or interleaved pairs (DeepSeek MLA:
x[2i] pairs with x[2i+1])."""

import math
from dataclasses import dataclass

import torch

from .. import ops
from ..errors import ModelError
from ..ops.rope import supports as native_rope_takes

ROPE_KINDS = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    dim: int
    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_positions: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    interleaved: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ModelError(f"unsupported rope type {self.kind!r}; supported: {', '.join(ROPE_KINDS)}")
        if self.dim <= 0 or self.dim % 2:
            raise ModelError(f"rope dimension must be positive and even, got {self.dim}")
        if self.theta <= 0 or self.factor <= 0:
            raise ModelError(f"rope theta and factor must be positive (theta={self.theta}, factor={self.factor})")
        if self.kind in ("llama3", "yarn") and self.original_max_positions <= 0:
            raise ModelError(f"rope type {self.kind} needs original_max_position_embeddings")


def inverse_frequencies(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim/2] float32, scale applied to cos and sin)."""
    base = 1.0 / (spec.theta ** (torch.arange(0, spec.dim, 2, dtype=torch.float32) / spec.dim))
    if spec.kind == "linear":
        return base / spec.factor, 1.0
    if spec.kind == "llama3":
        return _llama3(base, spec), 1.0
    if spec.kind == "yarn":
        return _yarn(spec), _yarn_attention_factor(spec)
    return base, 1.0


def _llama3(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    low_wavelen = spec.original_max_positions / spec.low_freq_factor
    high_wavelen = spec.original_max_positions / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (spec.original_max_positions / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec) -> torch.Tensor:
    # Dimensions rotating fewer than beta_slow times over the original context are
    # interpolated (divided by factor), those rotating more than beta_fast times are
    # kept; a linear ramp blends the band between.
    pos_freqs = spec.theta ** (torch.arange(0, spec.dim, 2, dtype=torch.float32) / spec.dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (spec.factor * pos_freqs)
    low, high = _yarn_correction_range(spec)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(spec.dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _yarn_correction_range(spec: RopeSpec) -> tuple[float, float]:
    def dim_for(rotations: float) -> float:
        return (spec.dim * math.log(spec.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(spec.theta))

    low, high = dim_for(spec.beta_fast), dim_for(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, spec.dim - 1)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(spec: RopeSpec) -> float:
    if spec.attention_factor is not None:
        return spec.attention_factor
    if spec.mscale and spec.mscale_all_dim:
        return yarn_mscale(spec.factor, spec.mscale) / yarn_mscale(spec.factor, spec.mscale_all_dim)
    return yarn_mscale(spec.factor)


def softmax_scale_factor(spec: RopeSpec) -> float:
    """DeepSeek's extra softmax scale under scaled rope: mscale(factor, mscale_all_dim)^2."""
    if spec.kind == "default" or not spec.mscale_all_dim:
        return 1.0
    return yarn_mscale(spec.factor, spec.mscale_all_dim) ** 2


@dataclass(frozen=True)
class RopeTables:
    """The factors that rotate one step's tokens: rotated x = x * cos + partner(x) * sin,
    where partner(x) swaps the two members of each pair and sin carries the pair's
    sign (-sin on the member that pairs forward). Products and sums are the same
    float operations as the textbook (x1 cos - x2 sin, x2 cos + x1 sin)."""
    cos: torch.Tensor   # [N, 1, dim]
    sin: torch.Tensor   # [N, 1, dim]


CACHED_POSITIONS = 8192     # positions whose tables Rotary keeps: [P, dim] cos and sin, 8 MB at dim 128


class Rotary(torch.nn.Module):
    """Each step looks its positions up in tables computed once for positions [0, P), P
    growing by powers of two up to CACHED_POSITIONS (past it, tables are computed per
    step): a decode step then costs two row gathers instead of a dozen small torch ops."""

    def __init__(self, spec: RopeSpec, device: torch.device):
        super().__init__()
        self.spec = spec
        inv_freq, self.scaling = inverse_frequencies(spec)
        self.inv_freq = inv_freq.to(device)
        self._cached: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}   # dtype -> [P, dim] x 2

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, dim/2] float32."""
        angles = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq
        return angles.cos() * self.scaling, angles.sin() * self.scaling

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, end: int | None = None) -> RopeTables:
        """positions [N] -> the step's RopeTables in the compute dtype. end: max(positions) + 1
        where the caller knows it (a batch's longest context), sparing a reduction and a sync;
        it only sizes the cached tables, which index_select bounds-checks against."""
        if end is None:
            end = int(positions.max()) + 1 if positions.numel() else 0
        if end > CACHED_POSITIONS:
            cos, sin = self._full_tables(positions, dtype)
            return RopeTables(cos[:, None, :], sin[:, None, :])
        cos, sin = self._cached_tables(end, dtype)
        rows = positions.to(cos.device)
        return RopeTables(cos.index_select(0, rows)[:, None, :], sin.index_select(0, rows)[:, None, :])

    def _cached_tables(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._cached.get(dtype)
        if cached is None or cached[0].shape[0] < end:
            size = min(CACHED_POSITIONS, max(256, 1 << max(end - 1, 0).bit_length()))
            cached = self._cached[dtype] = self._full_tables(torch.arange(size), dtype)
        return cached

    def _full_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, signed sin [N, dim] in dtype, in the layout apply() takes."""
        cos, sin = (t.to(dtype) for t in self.cos_sin(positions))
        if self.spec.interleaved:
            return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def apply_(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """apply(), in place where the native kernel takes x (float32 on the CPU, each row's
        heads contiguous): the same bits without torch's four temporaries."""
        if native_rope_takes(x) and tables.cos.dtype == torch.float32:
            return ops.rope_(x, tables.cos, tables.sin, self.spec.interleaved)
        return self.apply(x, tables)

    def apply(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """x [N, heads, dim] -> rotated x, same layout and dtype."""
        if self.spec.interleaved:
            partner = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        else:
            partner = x.roll(x.shape[-1] // 2, dims=-1)
        return x * tables.cos + partner * tables.sin
