"""The real default model (SmolLM2-135M-Instruct, llama, Q4_1) read through the
Checkpoint API, checked against gguf's own reader and an independent rope."""

import gguf
import numpy as np
import pytest
import torch

from kt_weights.checkpoint import open_checkpoint
from kt_weights.layout import Format


@pytest.fixture(scope="module")
def ckpt(smollm2_gguf):
    with open_checkpoint(smollm2_gguf) as c:
        yield c


@pytest.fixture(scope="module")
def reader(smollm2_gguf):
    return gguf.GGUFReader(smollm2_gguf)


def gguf_dequantized(reader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))


def test_config_is_smollm2_135m(ckpt):
    c = ckpt.config
    assert ckpt.architecture == "LlamaForCausalLM" == c["architectures"][0]
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (576, 1536, 30)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert (c["vocab_size"], c["max_position_embeddings"]) == (49152, 8192)
    assert c["rope_theta"] == 100000.0 and abs(c["rms_norm_eps"] - 1e-5) < 1e-9
    assert c["tie_word_embeddings"] is True and not ckpt.has("lm_head.weight")
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)


def test_names_are_hf_names(ckpt):
    names = ckpt.names()
    assert len(names) == 272 and "model.embed_tokens.weight" in names and "model.norm.weight" in names
    per_layer = {n.split(".", 3)[3] for n in names if n.startswith("model.layers.")}
    assert per_layer == {
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}


@pytest.mark.parametrize("hf, stored", [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.layers.7.mlp.down_proj.weight", "blk.7.ffn_down.weight"),
    ("model.layers.29.self_attn.v_proj.weight", "blk.29.attn_v.weight"),
    ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
])
def test_unpermuted_tensors_equal_gguf_dequantization(ckpt, reader, hf, stored):
    np.testing.assert_array_equal(ckpt.tensor(hf).numpy(), gguf_dequantized(reader, stored))


def test_formats_are_the_stored_ones(ckpt):
    assert ckpt.matrix("model.embed_tokens.weight").format == Format.I8
    q4 = ckpt.matrix("model.layers.0.mlp.up_proj.weight")
    assert (q4.format, q4.group, q4.rows, q4.cols) == (Format.I4, 32, 1536, 576) and q4.min is not None


def rope_adjacent_pairs(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """llama.cpp's rope for the llama architecture: rotates (x[2i], x[2i+1])."""
    d = x.shape[-1]
    angle = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * angle.cos() - b * angle.sin()
    out[..., 1::2] = a * angle.sin() + b * angle.cos()
    return out


def rope_rotate_half(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Hugging Face's rope: rotates (x[i], x[i + d/2])."""
    d = x.shape[-1]
    angle = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([angle.cos()] * 2), torch.cat([angle.sin()] * 2)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("layer", [0, 17])
def test_qk_unpermutation_gives_the_same_attention_scores(ckpt, reader, layer):
    """Scores from GGUF's rows with llama.cpp's rope must equal scores from our rows
    with HF's rope; without the un-permutation they differ."""
    c = ckpt.config
    heads, kv_heads, d, theta = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rope_theta"]
    gen = torch.Generator().manual_seed(layer)
    x_q, x_k = torch.randn(576, generator=gen, dtype=torch.float64), torch.randn(576, generator=gen, dtype=torch.float64)

    def scores(wq, wk, rope):
        q = rope((wq.double() @ x_q).reshape(heads, d), 11, theta)
        k = rope((wk.double() @ x_k).reshape(kv_heads, d), 4, theta)
        return (q * k.repeat_interleave(heads // kv_heads, dim=0)).sum(-1)

    wq_gguf = torch.from_numpy(gguf_dequantized(reader, f"blk.{layer}.attn_q.weight"))
    wk_gguf = torch.from_numpy(gguf_dequantized(reader, f"blk.{layer}.attn_k.weight"))
    wq, wk = ckpt.tensor(f"model.layers.{layer}.self_attn.q_proj.weight"), ckpt.tensor(f"model.layers.{layer}.self_attn.k_proj.weight")
    expected = scores(wq_gguf, wk_gguf, rope_adjacent_pairs)
    torch.testing.assert_close(scores(wq, wk, rope_rotate_half), expected, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(scores(wq_gguf, wk_gguf, rope_rotate_half), expected, rtol=1e-3, atol=1e-3)


def test_unpermuted_rows_are_the_stored_rows_reordered(ckpt, reader):
    stored = gguf_dequantized(reader, "blk.3.attn_k.weight")
    ours = ckpt.matrix("model.layers.3.self_attn.k_proj.weight")
    assert ours.format == Format.I4
    rows = ours.dequantize().numpy()
    assert sorted(map(bytes, rows)) == sorted(map(bytes, stored))
