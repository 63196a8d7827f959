"""Random HF-style checkpoints written directly with safetensors (no transformers
model): Qwen3-MoE layout, any size, one shard per layer, optionally FP8 e4m3
with 128x128 block scales or per-channel scales."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8_BLOCK = 128


def qwen3_config(layers: int, hidden: int, experts: int, inter: int, vocab: int = 512, heads: int = 4) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
            "intermediate_size": inter * 2, "moe_intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads // 2, "head_dim": hidden // heads,
            "num_experts": experts, "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": vocab,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []}


def layer_tensors(config: dict, layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, hd, i = config["hidden_size"], config["head_dim"], config["moe_intermediate_size"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    p = f"model.layers.{layer}."
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate.weight": (config["num_experts"], h)}
    for e in range(config["num_experts"]):
        shapes.update({f"mlp.experts.{e}.gate_proj.weight": (i, h), f"mlp.experts.{e}.up_proj.weight": (i, h),
                       f"mlp.experts.{e}.down_proj.weight": (h, i)})
    out = {p + n: ((torch.rand(s, generator=gen) - 0.5) * (12 / s[1]) ** 0.5).to(torch.bfloat16) for n, s in shapes.items()}
    for n, d in (("input_layernorm.weight", h), ("post_attention_layernorm.weight", h),
                 ("self_attn.q_norm.weight", hd), ("self_attn.k_norm.weight", hd)):
        out[p + n] = (1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    return out


def global_tensors(config: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    v, h = config["vocab_size"], config["hidden_size"]
    return {"model.embed_tokens.weight": torch.randn(v, h, generator=gen).to(torch.bfloat16),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "lm_head.weight": (torch.randn(v, h, generator=gen) / h ** 0.5).to(torch.bfloat16)}


def write_checkpoint(directory: Path, config: dict, seed: int = 0, fp8: str | None = None) -> Path:
    """fp8: None, "block" (weight_scale_inv per 128x128) or "channel" (weight_scale per row)."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    parts = [("globals", global_tensors(config, gen))]
    parts += [(f"layer{i}", layer_tensors(config, i, gen)) for i in range(config["num_hidden_layers"])]
    for k, (label, tensors) in enumerate(parts):
        if fp8:
            tensors = to_fp8(tensors, fp8)
        shard = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file(tensors, directory / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if fp8 == "block":
        config = dict(config, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def to_fp8(tensors: dict, mode: str) -> dict:
    out = {}
    for name, t in tensors.items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            out[name] = t
        elif mode == "block":
            out[name], out[name + "_scale_inv"] = fp8_blocks(t.float())
        else:
            scale = t.float().abs().amax(dim=1, keepdim=True) / 448.0
            out[name], out[name[:-len("weight")] + "weight_scale"] = (t.float() / scale).to(torch.float8_e4m3fn), scale
    return out


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    nr, nc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    pad = torch.zeros(nr * FP8_BLOCK, nc * FP8_BLOCK)
    pad[:rows, :cols] = w
    tiles = pad.reshape(nr, FP8_BLOCK, nc, FP8_BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).reshape(nr * FP8_BLOCK, nc * FP8_BLOCK)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def fp8_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Independent loop over tiles: w = q * scale of the tile."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            r, c = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK), slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
            out[r, c] = q[r, c].float() * scale[i, j]
    return out
