"""Bad checkpoints: every one must raise WeightsError with a one-line message
naming the file, never another exception."""

import json
import re
import struct

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kt_weights.checkpoint import open_checkpoint
from kt_weights.errors import WeightsError

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}


def expect_error(path_or_call, pattern: str, names: str):
    with pytest.raises(WeightsError) as info:
        if callable(path_or_call):
            path_or_call()
        else:
            open_checkpoint(path_or_call)
    message = str(info.value)
    assert "\n" not in message and names in message, message
    assert re.search(pattern, message), message
    return message


def hf_dir(tmp_path, tensors=None, config=CONFIG):
    tensors = tensors or {"a.weight": torch.randn(4, 8), "b.weight": torch.randn(8)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def rewrite_header(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + n:])


def test_missing_config(tmp_path):
    expect_error(hf_dir(tmp_path, config=None), "missing config.json", str(tmp_path))


def test_config_not_json(tmp_path):
    hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    expect_error(tmp_path, "not valid JSON", "config.json")


def test_config_without_architectures(tmp_path):
    expect_error(hf_dir(tmp_path, config={"hidden_size": 8}), "no 'architectures'", "config.json")


def test_missing_shard(tmp_path):
    hf_dir(tmp_path)
    index = {"weight_map": {"a.weight": "model.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(tmp_path, "missing shard model-00002-of-00002.safetensors", "index.json")


def test_tensor_missing_from_its_shard(tmp_path):
    hf_dir(tmp_path)
    index = {"weight_map": {"a.weight": "model.safetensors", "c.weight": "model.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(tmp_path, "'c.weight' listed in the index is missing", "model.safetensors")


def test_header_length_beyond_file(tmp_path):
    hf_dir(tmp_path)
    path = tmp_path / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(raw) * 10) + raw[8:])
    expect_error(tmp_path, "header length .* beyond the file size", "model.safetensors")


@pytest.mark.parametrize("cut", [1, 7, 9, 40, 100])
def test_truncated_safetensors(tmp_path, cut):
    hf_dir(tmp_path)
    path = tmp_path / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) - cut] if cut < len(raw) else raw[:3])
    expect_error(tmp_path, "truncated|out of range|not valid JSON", "model.safetensors")


def test_offsets_out_of_range(tmp_path):
    hf_dir(tmp_path)
    rewrite_header(tmp_path / "model.safetensors",
                   lambda h: h["a.weight"].update(data_offsets=[0, 10**6]))
    expect_error(tmp_path, "out of range", "model.safetensors")


def test_dtype_shape_mismatch(tmp_path):
    hf_dir(tmp_path)
    rewrite_header(tmp_path / "model.safetensors", lambda h: h["a.weight"].update(shape=[4, 9]))
    expect_error(tmp_path, "dtype/shape mismatch", "model.safetensors")


def test_unsupported_dtype(tmp_path):
    hf_dir(tmp_path)
    rewrite_header(tmp_path / "model.safetensors", lambda h: h["a.weight"].update(dtype="F4"))
    expect_error(tmp_path, "unsupported dtype F4", "model.safetensors")


def test_integer_tensor_is_not_a_matrix(tmp_path):
    ckpt = open_checkpoint(hf_dir(tmp_path, {"ids": torch.arange(12, dtype=torch.int32).reshape(3, 4)}))
    expect_error(lambda: ckpt.matrix("ids"), "not a supported matrix format", "model.safetensors")


def test_unknown_tensor_name(tmp_path):
    ckpt = open_checkpoint(hf_dir(tmp_path))
    expect_error(lambda: ckpt.tensor("nope.weight"), "no tensor named 'nope.weight'", str(tmp_path))
    expect_error(lambda: ckpt.experts(0, "sideways"), "not one of", str(tmp_path))


def test_nonexistent_path_and_uncached_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    expect_error(str(tmp_path / "absent"), "no such file", "absent")
    expect_error("nobody-here/no-such-model", "not found in the local Hugging Face cache", "nobody-here")


def write_gguf(path, arch="llama", tensors=None):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_head_count(2)
    for name, data in (tensors or {"blk.0.ffn_up.weight": np.ones((4, 32), np.float32)}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unknown_gguf_architecture(tmp_path):
    message = expect_error(write_gguf(tmp_path / "m.gguf", arch="gpt2"), "unsupported GGUF architecture 'gpt2'",
                           "m.gguf")
    assert "llama" in message and "deepseek2" in message


def test_gguf_bad_magic(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    expect_error(path, "not a GGUF file", "m.gguf")


def test_every_truncation_of_a_gguf_is_a_weights_error(tmp_path):
    source = write_gguf(tmp_path / "full.gguf").read_bytes()
    cut_path = tmp_path / "cut.gguf"
    for length in sorted({0, 3, 4, 8, 23, 24, 30, 50, 100, 200, *range(0, len(source) - 1, 97), len(source) - 1}):
        cut_path.write_bytes(source[:length])
        expect_error(cut_path, "GGUF|truncated|beyond the end", "cut.gguf")


def test_not_a_gguf_file_suffix(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    expect_error(path, "not a .gguf file", "weights.bin")
