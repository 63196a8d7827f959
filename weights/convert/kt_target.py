"""Writes the kt directory (weights/ktformat.py): per unit one safetensors file,
planned from the source headers, then filled tensor by tensor; quantization runs
in kt's native kernels on all threads."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..layout import LAYOUT_TAG, LAYOUT_VERSION, Format, QMatrix
from ..ktformat import EXPERT_NAME, FORMAT_FILE, FORMAT_NAMES, MANIFEST_FILE, MATRICES_KEY
from .files import SafetensorsStream, TensorSpec, file_sha256, planned_size, write_json_atomic
from .options import ConvertOptions
from .source import Source, Unit
from .stats import ErrorStats, matrix_error

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
                "chat_template.jinja", "chat_template.json")
_PLAIN = {"F32": "F32", "BF16": "BF16", "F16": "F16", "F8_E4M3": "BF16"}
_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")


@dataclass(frozen=True)
class Item:
    """One output matrix or tensor: `fmt` None = plain tensor in `plain_dtype`."""
    name: str
    shape: tuple[int, ...]
    fmt: Format | None
    group: int = 0
    plain_dtype: str = "BF16"
    source_name: str | None = None
    expert: tuple[int, str, int] | None = None      # (layer, proj, e)


def unit_file(unit: Unit) -> str:
    return "globals.safetensors" if unit.layer is None else f"layers/{unit.name}.safetensors"


class KTTarget:
    def __init__(self, source: Source, options: ConvertOptions, quantize) -> None:
        self.source, self.options, self.quantize = source, options, quantize
        self.fmt = FORMAT_NAMES[options.to]
        dst = options.destination
        self.staging = dst.with_name(dst.name + ".kt-partial")
        self.journal_path = self.staging / "journal.json"

    def begin(self, units: list[Unit], journal) -> list[str]:
        """Creates the staging directory; -> names of journaled units whose files verify."""
        self.staging.mkdir(parents=True, exist_ok=True)
        good = []
        for unit in units:
            rec = journal.units.get(unit.name)
            path = self.staging / unit_file(unit)
            if rec and path.is_file() and path.stat().st_size == rec["size"] and file_sha256(path) == rec["sha256"]:
                good.append(unit.name)
        journal.forget_from(good)
        return good

    def done_bytes(self, journal) -> int:
        return sum(r["size"] for r in journal.units.values())

    def plan(self, unit: Unit) -> tuple[list[Item], list[TensorSpec], dict]:
        items = [self._tensor_item(n) for n in unit.tensors]
        for s in unit.experts:
            group = self._group(s.cols)
            fmt = self.fmt if group or self.fmt == Format.BF16 else Format.BF16
            items += [Item(EXPERT_NAME.format(L=s.layer, E=e, P=s.proj), (s.rows, s.cols), fmt, group,
                           expert=(s.layer, s.proj, e)) for e in range(s.n)]
        specs, table = [], {}
        for item in items:
            specs += _specs(item, self.options.symmetric)
            if item.fmt is not None and item.fmt.quantized:
                table[item.name] = {"format": item.fmt.name, "rows": item.shape[0], "cols": item.shape[1],
                                    "group": item.group}
        return items, specs, _metadata(table)

    def estimate(self, unit: Unit) -> int:
        _, specs, meta = self.plan(unit)
        return planned_size(specs, meta)

    def write(self, unit: Unit, stats: ErrorStats) -> dict:
        items, specs, meta = self.plan(unit)
        path = self.staging / unit_file(unit)
        path.parent.mkdir(parents=True, exist_ok=True)
        out = SafetensorsStream(path, specs, meta)
        try:
            for item in items:
                self._write_item(out, item, stats)
            sha, size = out.finish()
        except BaseException:
            out.abort()
            raise
        return {"file": unit_file(unit), "sha256": sha, "size": size}

    def _write_item(self, out: SafetensorsStream, item: Item, stats: ErrorStats) -> None:
        w = self.source.expert(*item.expert) if item.expert else self.source.load(item.source_name)
        if item.fmt is None:
            out.write(item.name, w.to(_TORCH[item.plain_dtype]))
            return
        m = self._matrix(w, item)
        stats.add(item.name, matrix_error(m, w))
        out.write(item.name, m.data)
        for part, t in (("scale", m.scale), ("min", m.min)):
            if t is not None:
                out.write(f"{item.name}.{part}", t)

    def _matrix(self, w: torch.Tensor, item: Item) -> QMatrix:
        if not item.fmt.quantized:
            return QMatrix(item.fmt, *w.shape, w.to(_TORCH[item.fmt.name]).contiguous())
        return self.quantize(w.contiguous(), item.fmt, item.group, self.options.symmetric)

    def _tensor_item(self, name: str) -> Item:
        shape, dtype = self.source.shape(name), self.source.dtype(name)
        plain = _PLAIN[dtype]
        dense = len(shape) == 2 and name.endswith(".weight") and not name.endswith(_ROUTERS) \
            and "embed_tokens" not in name and not name.startswith("lm_head")
        if not dense:
            return Item(name, shape, None, plain_dtype=plain, source_name=name)
        group = self._group(shape[1])
        if self.options.experts_only or self.fmt == Format.BF16 or not group:
            return Item(name, shape, Format.BF16, source_name=name)
        return Item(name, shape, self.fmt, group, source_name=name)

    def _group(self, cols: int) -> int:
        """The requested group if it divides cols, else the largest smaller one that does; 0 = none."""
        if self.fmt == Format.BF16:
            return 0
        smallest = 32 if self.fmt == Format.I4 else 16
        for g in (128, 64, 32, 16):
            if smallest <= g <= self.options.group_size and cols % g == 0:
                return g
        return 0

    def finalize(self, units: list[Unit], journal) -> None:
        self._write_metadata(self.staging, units, journal.units)
        self.journal_path.unlink(missing_ok=True)

    def _write_metadata(self, staging: Path, units: list[Unit], records: dict) -> None:
        config = json.loads((self.source.directory / "config.json").read_text())
        config.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        for name in COPIED_FILES:
            if (self.source.directory / name).is_file():
                shutil.copyfile(self.source.directory / name, staging / name)
        files = [unit_file(u) for u in units]
        write_json_atomic(staging / FORMAT_FILE, self._format_meta(files))
        manifest = {r["file"]: {"sha256": r["sha256"], "size": r["size"]} for r in records.values()}
        for p in sorted(staging.iterdir()):
            if p.is_file() and p.name not in (MANIFEST_FILE,) and not p.name.startswith("journal"):
                manifest[p.name] = {"sha256": file_sha256(p), "size": p.stat().st_size}
        write_json_atomic(staging / MANIFEST_FILE, {"files": manifest})

    def _format_meta(self, files: list[str]) -> dict:
        o = self.options
        return {"layout": LAYOUT_TAG, "version": LAYOUT_VERSION, "format": o.to,
                "group_size": o.group_size, "symmetric": o.symmetric, "experts_only": o.experts_only,
                "architecture": self.source.architecture, "source": str(self.source.directory),
                "files": files}


def _specs(item: Item, symmetric: bool) -> list[TensorSpec]:
    if item.fmt is None:
        return [TensorSpec(item.name, item.plain_dtype, item.shape)]
    rows, cols = item.shape
    if not item.fmt.quantized:
        return [TensorSpec(item.name, item.fmt.name, item.shape)]
    data = TensorSpec(item.name, "U8" if item.fmt == Format.I4 else "I8",
                      (rows, cols // 2) if item.fmt == Format.I4 else (rows, cols))
    groups = (rows, cols // item.group)
    extra = [TensorSpec(f"{item.name}.scale", "F32", groups)]
    if not symmetric:
        extra.append(TensorSpec(f"{item.name}.min", "F32", groups))
    return [data, *extra]


def _metadata(table: dict) -> dict[str, str]:
    return {"kt_layout": LAYOUT_TAG, "kt_version": str(LAYOUT_VERSION),
            MATRICES_KEY: json.dumps(table, separators=(",", ":"))}
