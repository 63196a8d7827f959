"""MoE GGUF files written here the way llama.cpp's converter lays them out (names
from gguf's own TensorNameMap, experts stacked 3-D, llama q/k permuted, DeepSeek
kv_b split into k_b/v_b), read back and compared with the transformers model."""

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from kt_weights.checkpoint import open_checkpoint

Q = gguf.GGMLQuantizationType
_COMMON = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5)
_DS = dict(_COMMON, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_shared_experts=1,
           first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, num_experts_per_tok=2, n_routed_experts=4)
MODELS = {
    "mixtral": ("llama", "MixtralConfig", "MixtralForCausalLM",
                dict(_COMMON, intermediate_size=32, num_key_value_heads=2, num_local_experts=4,
                     num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_COMMON, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2,
                       head_dim=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen2_moe": ("qwen2moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_COMMON, intermediate_size=96, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, num_key_value_heads=2, num_experts=4,
                       num_experts_per_tok=2)),
    "deepseek_v3": ("deepseek2", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_DS, q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True,
                         routed_scaling_factor=2.5)),
    "deepseek_v2": ("deepseek2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(_DS, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)),
}
EXPERT_KEYS = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_files(kind, tmp_path):
    _, config_cls, model_cls, kwargs = MODELS[kind]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "hf")
    state = {k: v.float() for k, v in load_file(str(tmp_path / "hf" / "model.safetensors")).items()}
    return model.config, state


def write_gguf(path, arch, config, state, split_kv_b, expert_type):
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, arch, config)
    experts: dict = {}
    for name, t in state.items():
        w = t.numpy()
        parts = name.split(".")
        if ".experts." in name and parts[5].isdigit():
            proj = next(p for p, keys in EXPERT_KEYS.items() if parts[6] in keys)
            experts.setdefault((int(parts[2]), proj), {})[int(parts[5])] = w
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            w = llamacpp_permute(w, heads)
        if name.endswith("kv_b_proj.weight") and split_kv_b:
            _add_split_kv_b(writer, config, name, w, tmap)
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        gguf_name = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name, name
        writer.add_tensor(gguf_name, w.astype(np.float32 if w.ndim == 1 else np.float16))
    for (layer, proj), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        data = gguf.quants.quantize(stacked, expert_type) if expert_type != Q.F32 else stacked
        writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", data, raw_dtype=expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_split_kv_b(writer, config, name, w, tmap):
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    kv_b = w.reshape(heads, nope + v, w.shape[-1])
    k_b, v_b = kv_b[:, :nope], kv_b[:, nope:]
    layer = name.split(".")[2]
    writer.add_tensor(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(k_b.transpose(0, 2, 1), np.float16))
    writer.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(v_b, np.float16))


def _metadata(w, arch, c):
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(next(getattr(c, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                            if getattr(c, k, None)))
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen3moe":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "deepseek2":
        _deepseek_metadata(w, c)


def _deepseek_metadata(w, c):
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    if c.q_lora_rank:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    is_v3 = c.model_type == "deepseek_v3"
    w.add_expert_weights_norm(bool(getattr(c, "norm_topk_prob", False)))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if is_v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if is_v3:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)


CASES = [("mixtral", False, Q.F32), ("mixtral", False, Q.Q8_0), ("qwen3_moe", False, Q.F16),
         ("qwen2_moe", False, Q.F32), ("deepseek_v3", True, Q.Q8_0), ("deepseek_v2", False, Q.F32)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[2].name}{'-split' if c[1] else ''}")
def converted(request, tmp_path_factory):
    kind, split_kv_b, expert_type = request.param
    tmp = tmp_path_factory.mktemp(kind)
    config, state = hf_files(kind, tmp)
    write_gguf(tmp / "m.gguf", MODELS[kind][0], config, state, split_kv_b, expert_type)
    with open_checkpoint(tmp / "m.gguf") as ckpt:
        yield kind, expert_type, config, state, ckpt


def expected(state, name, expert_type):
    """float16 storage for matrices, the expert type's rounding for experts."""
    t = state[name]
    if ".experts." in name:
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), expert_type), expert_type)
                                if expert_type != Q.F32 else t.numpy())
    return t if t.ndim == 1 else t.half().float()


def test_architecture_and_config(converted):
    kind, _, config, _, ckpt = converted
    assert ckpt.architecture == MODELS[kind][2]
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts_per_tok",
            "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts", "head_dim",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob",
            "shared_expert_intermediate_size", "n_group", "topk_group", "num_key_value_heads"]
    for key in keys:
        if key in ckpt.config and (getattr(config, key, None) is not None or key == "q_lora_rank"):
            assert ckpt.config[key] == getattr(config, key), key
    assert ckpt.config["rope_theta"] == config.rope_parameters["rope_theta"]
    if kind.startswith("deepseek"):
        assert ckpt.config["scoring_func"] == ("sigmoid" if kind == "deepseek_v3" else "softmax")


def test_names_and_tensors_match_the_hf_files(converted):
    _, expert_type, _, state, ckpt = converted
    assert set(ckpt.names()) == set(state)
    for name in state:
        torch.testing.assert_close(ckpt.tensor(name), expected(state, name, expert_type),
                                   rtol=0, atol=0, msg=name)


def test_experts_are_the_per_expert_matrices(converted):
    kind, expert_type, config, state, ckpt = converted
    for proj, keys in EXPERT_KEYS.items():
        experts = ckpt.experts(1, proj)
        assert len(experts) == 4
        for e, m in enumerate(experts):
            key = keys[1] if kind == "mixtral" else keys[0]
            name = next(n for n in state if n.startswith("model.layers.1.") and f".{e}.{key}." in n)
            assert (m.rows, m.cols) == tuple(state[name].shape)
            torch.testing.assert_close(m.dequantize(), expected(state, name, expert_type), rtol=0, atol=0)
