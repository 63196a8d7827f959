"""Writes one GGUF file as a stream. The whole layout (metadata, tensor infos,
every tensor's type, shape and offset) is planned from the source headers; the
header is written first, then the data unit by unit, each unit a byte range whose
sha256 goes into the journal, so --resume verifies and continues mid-file.

Tensor layout follows llama.cpp's converter: names from gguf's TensorNameMap,
routed experts stacked 3-D as blk.L.ffn_{gate,up,down}_exps (E, rows, cols), llama
q/k rows permuted for its adjacent-pair rope, DeepSeek kv_b split into attn_k_b
(H, kv_lora, nope) and attn_v_b (H, v, kv_lora), llama3 rope as rope_freqs."""

import hashlib
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
import torch

from ..errors import WeightsError
from .gguf_meta import GGUF_ARCH, add_model_metadata, add_tokenizer, head_dim, rope_params
from .journal import remove
from .options import ConvertOptions
from .source import Source, Unit
from .stats import SAMPLE_ROWS, ErrorStats, relative_error

Q = gguf.GGMLQuantizationType
QTYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}
F32_SUFFIXES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "exp_probs_b.bias", "rope_freqs.weight")
ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT


@dataclass
class GTensor:
    name: str
    shape: tuple[int, ...]          # numpy order; ne is reversed
    qtype: Q
    source: str                     # HF name, for error stats
    chunks: Callable[[], Iterator[np.ndarray]]   # float32 row blocks, in order

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * size


def _pad(n: int) -> int:
    return -n % ALIGNMENT


class GGUFTarget:
    def __init__(self, source: Source, options: ConvertOptions, units: list[Unit]) -> None:
        self.source, self.options, self.config = source, options, source.config
        self.arch = GGUF_ARCH[source.architecture]
        self.qtype = QTYPES[options.gguf_type]
        self.tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[self.arch.upper()], self.config["num_hidden_layers"])
        self.staging = options.destination.with_name(options.destination.name + ".partial")
        self.journal_path = options.destination.with_name(options.destination.name + ".partial.json")
        self.unmapped: list[str] = []
        self.tensors = {u.name: self._unit_tensors(u) for u in units}
        self.header, self.notes = self._header_bytes()
        self.ranges = self._ranges(units)

    # ---- layout --------------------------------------------------------------------
    def _unit_tensors(self, unit: Unit) -> list[GTensor]:
        out: list[GTensor] = []
        for name in unit.tensors:
            out += self._mapped(name)
        for s in unit.experts:
            chunks = (lambda s=s: (self.source.expert(s.layer, s.proj, e).numpy() for e in range(s.n)))
            name = f"blk.{s.layer}.ffn_{s.proj}_exps.weight"
            out.append(GTensor(name, (s.n, s.rows, s.cols), self._type(name, (s.rows, s.cols), True),
                               f"model.layers.{s.layer}.mlp.experts.{s.proj}", chunks))
        if unit.layer is None and rope_params(self.config)["rope_type"] == "llama3" and self.arch == "llama":
            factors = llama3_rope_factors(self.config)
            out.append(GTensor("rope_freqs.weight", factors.shape, Q.F32, "rope_freqs", lambda: iter([factors[None]])))
        return out

    def _mapped(self, name: str) -> list[GTensor]:
        c, shape = self.config, self.source.shape(name)
        if name == "lm_head.weight" and c.get("tie_word_embeddings"):
            return []
        if self.arch == "deepseek2" and name.endswith("kv_b_proj.weight"):
            return self._split_kv_b(name, shape)
        key = name.replace("e_score_correction_bias", "e_score_correction.bias")
        gname = self.tmap.get_name(key, try_suffixes=(".weight", ".bias"))
        if gname is None:
            self.unmapped.append(name)
            return []
        heads = self._permute_heads(name)
        load = (lambda: iter([_permute(self.source.load(name), heads)])) if heads else \
            (lambda: iter([self.source.load(name).reshape(-1, shape[-1]).numpy()]))
        return [GTensor(gname, shape, self._type(gname, shape, False), name, load)]

    def _permute_heads(self, name: str) -> int | None:
        if self.arch != "llama":
            return None
        if name.endswith("self_attn.q_proj.weight"):
            return self.config["num_attention_heads"]
        if name.endswith("self_attn.k_proj.weight"):
            return self.config.get("num_key_value_heads", self.config["num_attention_heads"])
        return None

    def _split_kv_b(self, name: str, shape: tuple) -> list[GTensor]:
        c = self.config
        heads, nope, v, lora = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"], shape[1]
        if shape[0] != heads * (nope + v):
            raise WeightsError(f"{name}: shape {list(shape)} is not heads x (nope + v) = {heads * (nope + v)} rows")
        layer = name.split(".")[2]

        def part(which: str):
            kv_b = self.source.load(name).reshape(heads, nope + v, lora)
            t = kv_b[:, :nope].transpose(1, 2) if which == "k" else kv_b[:, nope:]
            return iter([t.contiguous().reshape(-1, t.shape[-1]).numpy()])

        k_shape, v_shape = (heads, lora, nope), (heads, v, lora)
        return [GTensor(f"blk.{layer}.attn_k_b.weight", k_shape, self._type("k_b", k_shape, False), name,
                        lambda: part("k")),
                GTensor(f"blk.{layer}.attn_v_b.weight", v_shape, self._type("v_b", v_shape, False), name,
                        lambda: part("v"))]

    def _type(self, gname: str, shape: tuple, expert: bool) -> Q:
        if len(shape) == 1 or gname.endswith(F32_SUFFIXES):
            return Q.F32
        want = self.qtype
        if self.options.experts_only and not expert and want not in (Q.F32, Q.F16, Q.BF16):
            want = Q.F16
        return want if shape[-1] % gguf.GGML_QUANT_SIZES[want][0] == 0 else Q.F16

    def _header_bytes(self) -> tuple[bytes, list[str]]:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "header.gguf"
            w = gguf.GGUFWriter(path, self.arch)
            add_model_metadata(w, self.arch, self.config, self.source.directory.name, self.options.gguf_type)
            note = add_tokenizer(w, self.source.directory, self.config)
            for tensors in self.tensors.values():
                for t in tensors:
                    w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.close()
            raw = path.read_bytes()
        notes = [note] if note else []
        if self.unmapped:
            notes.append(f"not in GGUF (no llama.cpp name): {', '.join(self.unmapped[:4])}"
                         f"{' ...' if len(self.unmapped) > 4 else ''}")
        return raw + b"\0" * _pad(len(raw)), notes

    def _ranges(self, units: list[Unit]) -> dict[str, tuple[int, int]]:
        pos, ranges = len(self.header), {}
        for u in units:
            start = pos
            pos += sum(t.nbytes + _pad(t.nbytes) for t in self.tensors[u.name])
            ranges[u.name] = (start, pos)
        return ranges

    def estimate(self, unit: Unit) -> int:
        start, end = self.ranges[unit.name]
        return end - start + (len(self.header) if unit.index == 0 else 0)

    # ---- writing ---------------------------------------------------------------------
    def done_bytes(self, journal) -> int:
        return sum(r["size"] for r in journal.units.values())

    def begin(self, units: list[Unit], journal) -> list[str]:
        header_sha = hashlib.sha256(self.header).hexdigest()
        header_ok = journal.extra.get("header_sha256") == header_sha and self.staging.is_file() \
            and _sha_range(self.staging, 0, len(self.header)) == header_sha
        good = self._verified_units(units, journal) if header_ok else []
        if not header_ok:
            remove(self.staging)
            self.staging.write_bytes(self.header)
        with open(self.staging, "r+b") as f:
            f.truncate(self.ranges[good[-1]][1] if good else len(self.header))
        journal.extra["header_sha256"] = header_sha
        journal.forget_from(good)
        return good

    def _verified_units(self, units: list[Unit], journal) -> list[str]:
        good = []
        for u in units:
            rec = journal.units.get(u.name)
            start, end = self.ranges[u.name]
            if not rec or rec["start"] != start or _sha_range(self.staging, start, end) != rec["sha256"]:
                break
            good.append(u.name)
        return good

    def write(self, unit: Unit, stats: ErrorStats) -> dict:
        start, end = self.ranges[unit.name]
        digest = hashlib.sha256()
        with open(self.staging, "r+b") as f:
            f.seek(start)
            for t in self.tensors[unit.name]:
                self._write_tensor(f, t, digest, stats)
            if f.tell() != end:
                raise WeightsError(f"{self.staging}: internal error: unit {unit.name} ends at {f.tell()}, "
                                   f"planned {end}")
            f.flush()
            os.fsync(f.fileno())
        return {"start": start, "end": end, "size": end - start, "sha256": digest.hexdigest()}

    def _write_tensor(self, f, t: GTensor, digest, stats: ErrorStats) -> None:
        for chunk in t.chunks():
            chunk = np.ascontiguousarray(chunk, dtype=np.float32).reshape(-1, t.shape[-1])
            q = encode(chunk, t.qtype)
            if t.qtype != Q.F32:
                rows = np.linspace(0, len(chunk) - 1, min(len(chunk), SAMPLE_ROWS)).astype(np.int64)
                stats.add(t.source, relative_error(decode(q[rows], t.qtype, (len(rows), chunk.shape[1])),
                                                   chunk[rows]))
            data = memoryview(np.ascontiguousarray(q)).cast("B")
            f.write(data)
            digest.update(data)
        pad = b"\0" * _pad(t.nbytes)
        f.write(pad)
        digest.update(pad)

    def finalize(self, units: list[Unit], journal) -> None:
        if self.notes:
            journal.extra["notes"] = self.notes
        self.journal_path.unlink(missing_ok=True)


def encode(chunk: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return chunk
    if qtype == Q.F16:
        return chunk.astype(np.float16)
    return gguf.quants.quantize(chunk, qtype)


def decode(q: np.ndarray, qtype: Q, shape: tuple) -> np.ndarray:
    if qtype == Q.F16:
        return q.astype(np.float32)
    return gguf.quants.dequantize(q, qtype).reshape(shape)


def _permute(w: torch.Tensor, heads: int) -> np.ndarray:
    """HF's rotate_half row order -> llama.cpp's adjacent pairs, per head."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).numpy()


def llama3_rope_factors(config: dict) -> np.ndarray:
    """Per frequency divisor of llama3 rope scaling (Meta's published formula):
    high frequencies kept, low ones divided by `factor`, a smooth ramp between."""
    rope, dim = rope_params(config), head_dim(config)
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    ramp = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, ramp))
    return out.astype(np.float32)


def _sha_range(path: Path, start: int, end: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            block = f.read(min(left, 1 << 22))
            if not block:
                return ""
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()
