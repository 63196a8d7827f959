"""A .gguf file (or a split set, `name-00001-of-00003.gguf`) as a Checkpoint with
HF names and shapes. Tensors are numpy views of gguf's memory map; quantized
blocks are repacked into kt's layout on demand (gguf_repack), one matrix or one
expert at a time."""

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checkpoint import Checkpoint
from .errors import WeightsError
from .gguf_config import build_config, check_architecture
from .gguf_file import GGUFFile
from .gguf_names import (EXPERT_NAMES, EXPERT_TENSORS, KV_B_NAME, MLA_SPLIT, PERMUTED_ROWS,
                         WEIGHT_MAPS, hf_name)
from .gguf_repack import FLOAT_TYPES, REPACKERS, SUPPORTED_TYPES, float_view
from .layout import Format, QMatrix

_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class _Source:
    gguf_name: str
    expert: int | None = None
    kv_b_layer: int | None = None


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise WeightsError(f"{self.path}: no such GGUF file")
        first = GGUFFile(self.path)
        self._files = [first] + [GGUFFile(p) for p in _split_files(self.path, first)[1:]]
        self._metadata = first.metadata
        self._gguf = {name: t for f in self._files for name, t in f.tensors.items()}
        self.arch = str(self._meta("general.architecture", ""))
        check_architecture(self.arch, self.path)
        self.config = self._build_config()
        self.architecture = self.config["architectures"][0]
        self._sources = self._map_names()
        self._names = dict.fromkeys(self._sources)

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                local_files_only=True)
        except Exception as err:
            raise WeightsError(f"{self.path}: cannot build the tokenizer from GGUF metadata ({err})") from None
        template = self._meta("tokenizer.chat_template", None)
        if template and not tok.chat_template:
            tok.chat_template = template
        return tok

    def close(self) -> None:
        self._files, self._gguf, self._sources, self._names = [], {}, {}, {}

    def _meta(self, key: str, default=None):
        return self._metadata.get(key, default)

    def _build_config(self) -> dict:
        n_vocab = len(self._metadata.get("tokenizer.ggml.tokens", ()))
        try:
            config = build_config(
                self.arch, self._meta, has_output="output.weight" in self._gguf,
                has_experts=any(n.endswith("_exps.weight") for n in self._gguf),
                has_score_bias=any(n.endswith("exp_probs_b.bias") for n in self._gguf), n_vocab=n_vocab)
        except WeightsError as err:
            raise WeightsError(f"{self.path}: {err}") from None
        return config

    def _map_names(self) -> dict[str, _Source]:
        sources: dict[str, _Source] = {}
        for name, t in self._gguf.items():
            layer, proj = _expert_tensor(name)
            if proj is not None:
                template = EXPERT_NAMES[self.arch][proj]
                for e in range(t.shape[0]):
                    sources[template.format(L=layer, E=e)] = _Source(name, expert=e)
            elif (target := hf_name(self.arch, name)) is not None:
                sources[target] = _Source(name)
        for layer in range(self.config["num_hidden_layers"]):
            if all(s.format(L=layer) in self._gguf for s in MLA_SPLIT.values()):
                sources[KV_B_NAME.format(L=layer)] = _Source(MLA_SPLIT["v_b"].format(L=layer),
                                                             kv_b_layer=layer)
        return sources

    def _load_tensor(self, name: str) -> torch.Tensor:
        source = self._sources[name]
        t = self._gguf[source.gguf_name]
        if source.expert is None and source.kv_b_layer is None and len(t.shape) == 1:
            return self._decode(source.gguf_name, self._raw(source.gguf_name)).dequantize()[0]
        return self._load_matrix(name).dequantize()

    def _load_matrix(self, name: str) -> QMatrix:
        source = self._sources[name]
        if source.kv_b_layer is not None:
            return self._merged_kv_b(source.kv_b_layer)
        raw = self._raw(source.gguf_name)
        if source.expert is not None:
            return self._decode(source.gguf_name, raw[source.expert])
        if raw.ndim != 2:
            raise WeightsError(f"{self.path}: tensor {source.gguf_name!r} ({name}) is not a matrix")
        return self._unpermute(source.gguf_name, self._decode(source.gguf_name, raw))

    def _raw(self, gguf_name: str) -> np.ndarray:
        data = self._gguf[gguf_name].data
        return data.reshape(1, -1) if data.ndim == 1 else data

    def _decode(self, gguf_name: str, raw: np.ndarray) -> QMatrix:
        kind, cols = self._gguf[gguf_name].type_name, self._gguf[gguf_name].shape[-1]
        if kind in FLOAT_TYPES:
            data = float_view(raw, kind)
            return QMatrix(FLOAT_TYPES[kind][0], data.shape[0], data.shape[1], data)
        if kind not in REPACKERS:
            raise WeightsError(f"{self.path}: tensor {gguf_name!r} has unsupported GGUF type {kind} "
                               f"(supported: {', '.join(SUPPORTED_TYPES)})")
        try:
            return REPACKERS[kind](raw, cols)
        except WeightsError as err:
            raise WeightsError(f"{self.path}: tensor {gguf_name!r} ({kind}): {err}") from None

    def _unpermute(self, gguf_name: str, m: QMatrix) -> QMatrix:
        suffix = gguf_name.split(".", 2)[-1]
        heads_key = PERMUTED_ROWS.get(self.arch, {}).get(suffix)
        if heads_key is None:
            return m
        heads = self.config["num_attention_heads" if heads_key == "head_count" else "num_key_value_heads"]
        perm = unpermute_rows(m.rows, heads)
        return QMatrix(m.format, m.rows, m.cols, m.data[perm], m.group,
                       None if m.scale is None else m.scale[perm], None if m.min is None else m.min[perm])

    def _merged_kv_b(self, layer: int) -> QMatrix:
        # k_b [H, kv_lora, nope] (transposed per head), v_b [H, v_dim, kv_lora]
        # -> kv_b_proj [H * (nope + v_dim), kv_lora], per head the nope rows then the v rows
        k_b = self._dequantize_3d(MLA_SPLIT["k_b"].format(L=layer))
        v_b = self._dequantize_3d(MLA_SPLIT["v_b"].format(L=layer))
        heads, kv_lora = k_b.shape[0], k_b.shape[1]
        merged = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, kv_lora).contiguous()
        return QMatrix(Format.F32, merged.shape[0], kv_lora, merged)

    def _dequantize_3d(self, gguf_name: str) -> torch.Tensor:
        raw = self._gguf[gguf_name].data
        flat = raw.reshape(-1, raw.shape[-1])
        return self._decode(gguf_name, flat).dequantize().reshape(*raw.shape[:-1], -1)


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: within each head GGUF
    stores rows interleaved (r0, r_{d/2}, r1, r_{d/2+1}, ...) for its adjacent-pair
    rope; HF keeps the two halves apart for rotate_half. hf = gguf[perm]."""
    if rows % heads or (rows // heads) % 2:
        raise WeightsError(f"cannot un-permute {rows} rows over {heads} heads")
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def _expert_tensor(gguf_name: str) -> tuple[int | None, str | None]:
    for proj, template in EXPERT_TENSORS.items():
        match = re.fullmatch(template.replace(".", r"\.").replace("{L}", r"(\d+)"), gguf_name)
        if match:
            return int(match.group(1)), proj
    return None, None


def _split_files(path: Path, first: GGUFFile) -> list[Path]:
    count = int(first.metadata.get("split.count", 1))
    if count <= 1:
        return [path]
    match = _SPLIT_NAME.match(path.name)
    if not match or int(match["index"]) != 1:
        raise WeightsError(f"{path}: part of a {count}-file split GGUF; open the -00001-of- file")
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for part in parts:
        if not part.is_file():
            raise WeightsError(f"{path}: split GGUF part {part.name} is missing")
    return parts
