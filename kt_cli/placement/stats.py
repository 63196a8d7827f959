"""Expert activation statistics: routed tokens per (MoE layer, expert), saved atomically
as JSON or safetensors (chosen by the file suffix) with the model id and the layer list.

JSON:         {"format": "kt-expert-stats", "version": 1, "model": ID, "layers": [decoder layer ids],
               "num_experts": E, "counts": [[int] * E] * L}
safetensors:  tensors counts int64 [L, E] and layers int64 [L]; metadata format, version, model."""

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .errors import PlacementError

FORMAT_TAG = "kt-expert-stats"
FORMAT_VERSION = 1
SAFETENSORS_SUFFIXES = (".safetensors", ".st")


@dataclass(frozen=True)
class ExpertStats:
    model: str
    layers: tuple[int, ...]        # decoder layer index of each MoE layer, in order
    counts: torch.Tensor           # int64 [L, E]

    def __post_init__(self) -> None:
        counts = self.counts
        if not isinstance(counts, torch.Tensor) or counts.dim() != 2:
            raise PlacementError(f"expert counts must be a 2-D tensor [layers, experts], got {_shape(counts)}")
        if counts.shape[0] != len(self.layers):
            raise PlacementError(f"expert counts have {counts.shape[0]} layers but {len(self.layers)} layer ids")
        if counts.is_floating_point():
            if not torch.isfinite(counts).all() or (counts != counts.round()).any():
                raise PlacementError("expert counts must be finite whole numbers")
        if (counts < 0).any():
            raise PlacementError("expert counts must be >= 0")
        object.__setattr__(self, "counts", counts.to(torch.int64).cpu())
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.counts.shape)

    def check_matches(self, model: str, layers: tuple[int, ...], num_experts: int, source: str = "") -> None:
        where = f"expert statistics {source}: " if source else "expert statistics: "
        if self.model != model:
            raise PlacementError(f"{where}recorded for model {self.model!r}, this model is {model!r}")
        if self.layers != tuple(layers) or self.shape[1] != num_experts:
            raise PlacementError(f"{where}shape {self.shape[0]}x{self.shape[1]} on layers {list(self.layers)}, "
                                 f"the model has {len(layers)}x{num_experts} on layers {list(layers)}")

    def save(self, path: str | Path) -> Path:
        """Writes to a temporary file beside `path`, then renames it over `path`."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            self._write(Path(tmp), path.suffix in SAFETENSORS_SUFFIXES)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def _write(self, tmp: Path, as_safetensors: bool) -> None:
        if as_safetensors:
            tensors = {"counts": self.counts.contiguous(), "layers": torch.tensor(self.layers, dtype=torch.int64)}
            save_file(tensors, tmp, metadata={"format": FORMAT_TAG, "version": str(FORMAT_VERSION),
                                              "model": self.model})
            return
        doc = {"format": FORMAT_TAG, "version": FORMAT_VERSION, "model": self.model, "layers": list(self.layers),
               "num_experts": self.shape[1], "counts": self.counts.tolist()}
        tmp.write_text(json.dumps(doc))


def load(path: str | Path) -> ExpertStats:
    """Any problem with the file -> PlacementError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise PlacementError(f"expert statistics {path}: no such file")
    try:
        if path.suffix in SAFETENSORS_SUFFIXES:
            return _from_safetensors(path)
        return _from_json(path)
    except PlacementError as err:
        raise PlacementError(f"expert statistics {path}: {err}") from None


def _from_json(path: Path) -> ExpertStats:
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PlacementError(f"not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise PlacementError("not a kt expert-statistics document")
    _check_header(doc.get("format"), doc.get("version"), doc.get("model"))
    counts, layers = doc.get("counts"), doc.get("layers")
    if not _int_list(layers):
        raise PlacementError("'layers' must be a list of layer indices")
    if not isinstance(counts, list) or not all(isinstance(row, list) for row in counts):
        raise PlacementError("'counts' must be a list of per-layer lists")
    if len({len(row) for row in counts}) > 1 or (counts and len(counts[0]) != doc.get("num_experts")):
        raise PlacementError(f"'counts' rows must all have num_experts={doc.get('num_experts')!r} entries")
    if not all(_number(v) for row in counts for v in row):
        raise PlacementError("'counts' must hold numbers only")
    tensor = torch.tensor(counts, dtype=torch.float64).reshape(len(counts), -1)
    return ExpertStats(doc["model"], tuple(layers), tensor)


def _from_safetensors(path: Path) -> ExpertStats:
    try:
        tensors = load_file(path)
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise PlacementError(f"not a readable safetensors file ({err})") from None
    version = meta.get("version")
    _check_header(meta.get("format"), int(version) if str(version).isdigit() else version, meta.get("model"))
    if set(tensors) != {"counts", "layers"}:
        raise PlacementError(f"expected tensors 'counts' and 'layers', found {sorted(tensors)}")
    layers = tensors["layers"]
    if layers.dim() != 1 or layers.is_floating_point():
        raise PlacementError("'layers' must be a 1-D integer tensor")
    return ExpertStats(meta["model"], tuple(layers.tolist()), tensors["counts"].to(torch.float64))


def _check_header(tag, version, model) -> None:
    if tag != FORMAT_TAG:
        raise PlacementError(f"format tag is {tag!r}, expected {FORMAT_TAG!r}")
    if version != FORMAT_VERSION:
        raise PlacementError(f"format version {version!r} unsupported (this kt reads {FORMAT_VERSION})")
    if not isinstance(model, str) or not model:
        raise PlacementError("the file names no model")


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shape(value) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__
