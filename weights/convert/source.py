"""The checkpoint being converted, cut into units of work: one unit for the
tensors outside the decoder layers ("globals"), then one per decoder layer.
Everything here reads headers only; tensors are read one at a time later, as
private copies (HFCheckpoint streaming mode), so nothing stays resident."""

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import EXPERT_PROJS, _looks_like_repo_id, _resolve_cached_repo
from ..errors import WeightsError
from ..hf_checkpoint import HFCheckpoint

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                           "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
FLOAT_DTYPES = ("F32", "BF16", "F16")
FP8_DTYPES = ("F8_E4M3",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_PROJ_KEYS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


@dataclass
class ExpertSet:
    """One projection of one layer's routed experts: n matrices of (rows, cols)."""
    layer: int
    proj: str
    n: int
    rows: int
    cols: int


@dataclass
class Unit:
    index: int
    name: str
    layer: int | None
    tensors: list[str] = field(default_factory=list)
    experts: list[ExpertSet] = field(default_factory=list)
    source_bytes: int = 0


class Source:
    def __init__(self, spec: str) -> None:
        self.directory = resolve_source(spec)
        self.ckpt = HFCheckpoint(self.directory, streaming=True)
        self.config = self.ckpt.config
        self.architecture = self.ckpt.architecture
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise WeightsError(f"{self.directory}: unsupported architecture {self.architecture} "
                               f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self._fused: tuple[str, torch.Tensor] | None = None

    def close(self) -> None:
        self._fused = None
        self.ckpt.close()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.ckpt.entry(name).shape)

    def dtype(self, name: str) -> str:
        return self.ckpt.entry(name).dtype

    def load(self, name: str) -> torch.Tensor:
        """float32 copy in the stored shape (FP8 dequantized)."""
        return self.ckpt.tensor(name)

    def expert(self, layer: int, proj: str, e: int) -> torch.Tensor:
        """float32 (rows, cols) of expert e."""
        for template in _expert_templates(layer, proj):
            if self.ckpt.has(template.format(E=e)):
                return self.ckpt.tensor(template.format(E=e))
        return self._fused_slice(layer, proj, e)

    def _fused_slice(self, layer: int, proj: str, e: int) -> torch.Tensor:
        name = f"model.layers.{layer}.mlp.experts.{'down_proj' if proj == 'down' else 'gate_up_proj'}"
        if self._fused is None or self._fused[0] != name:
            self._fused = None
            self._fused = (name, self.ckpt.tensor(name))
        stacked = self._fused[1]
        if proj == "down":
            return stacked[e].contiguous()
        half = stacked.shape[1] // 2
        return stacked[e, :half].contiguous() if proj == "gate" else stacked[e, half:].contiguous()

    def files(self) -> list[Path]:
        return [self.directory / "config.json", *self.ckpt.files()]

    def plan_units(self) -> tuple[list[Unit], list[str]]:
        """-> units in order, names skipped (layers past num_hidden_layers, e.g. MTP)."""
        n_layers = int(self.config.get("num_hidden_layers", 0))
        units = [Unit(0, "globals", None)] + [Unit(i + 1, f"layer-{i:05d}", i) for i in range(n_layers)]
        skipped: list[str] = []
        for name in sorted(self.ckpt.names()):
            self._check_dtype(name)
            match = _LAYER.match(name)
            layer = int(match.group(1)) if match else None
            if layer is not None and layer >= n_layers:
                skipped.append(name)
                continue
            unit = units[0] if layer is None else units[layer + 1]
            unit.source_bytes += self.ckpt.stored_bytes(name)
            if not self._add_expert(unit, name):
                unit.tensors.append(name)
        for unit in units:
            unit.experts.sort(key=lambda s: EXPERT_PROJS.index(s.proj))
        return units, skipped

    def _add_expert(self, unit: Unit, name: str) -> bool:
        per = _PER_EXPERT.match(name)
        if per and per.group(3) in _PROJ_KEYS:
            proj = _PROJ_KEYS[per.group(3)]
            if not any(s.proj == proj for s in unit.experts):
                n = len(self.ckpt._per_expert_names(unit.layer, proj))
                rows, cols = self.shape(name)
                unit.experts.append(ExpertSet(unit.layer, proj, n, rows, cols))
            return True
        fused = _FUSED.match(name)
        if not fused:
            return False
        shape = self.shape(name)
        if len(shape) != 3:
            raise WeightsError(f"{self.directory}: fused experts {name!r} have shape {list(shape)}, not 3-D")
        projs = ("down",) if fused.group(2) == "down_proj" else ("gate", "up")
        for proj in projs:
            rows = shape[1] if proj == "down" else shape[1] // 2
            unit.experts.append(ExpertSet(unit.layer, proj, shape[0], rows, shape[2]))
        return True

    def _check_dtype(self, name: str) -> None:
        dtype = self.dtype(name)
        if dtype not in FLOAT_DTYPES + FP8_DTYPES:
            raise WeightsError(f"{self.directory}: tensor {name!r} has dtype {dtype}; kt convert reads "
                               f"{', '.join(FLOAT_DTYPES + FP8_DTYPES)}")


def _expert_templates(layer: int, proj: str) -> list[str]:
    keys = [k for k, p in _PROJ_KEYS.items() if p == proj]
    return [f"model.layers.{layer}.{block}.experts.{{E}}.{key}.weight"
            for block in ("mlp", "block_sparse_moe") for key in keys]


def resolve_source(spec: str) -> Path:
    local = Path(spec).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise WeightsError(f"{spec}: SRC must be a Hugging Face model directory (or cached repo id)")
    if _looks_like_repo_id(str(spec)):
        return _resolve_cached_repo(str(spec))
    raise WeightsError(f"{spec}: no such directory (and not a cached Hugging Face repo id)")
