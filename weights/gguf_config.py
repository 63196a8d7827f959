"""GGUF metadata -> a Hugging Face style config.json dict, so that model code
reads one set of key names whatever the checkpoint format."""

from typing import Any, Callable

from .errors import WeightsError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2moe", "qwen3moe", "deepseek2")
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}

Meta = Callable[[str, Any], Any]


def hf_architecture(arch: str, has_experts: bool, is_v3: bool) -> str:
    if arch == "llama":
        return "MixtralForCausalLM" if has_experts else "LlamaForCausalLM"
    return {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
            "deepseek2": "DeepseekV3ForCausalLM" if is_v3 else "DeepseekV2ForCausalLM"}[arch]


def build_config(arch: str, meta: Meta, *, has_output: bool, has_experts: bool, has_score_bias: bool,
                 n_vocab: int) -> dict:
    def m(key, default=None):
        return meta(f"{arch}.{key}", default)

    is_v3 = arch == "deepseek2" and (has_score_bias or m("expert_gating_func") == 2)
    architecture = hf_architecture(arch, has_experts, is_v3)
    config = _common(m, meta, architecture, has_output, n_vocab)
    if arch == "llama" and has_experts:
        config.update(_mixtral(m))
    elif arch in ("qwen2moe", "qwen3moe"):
        config.update(_qwen_moe(m, arch))
    elif arch == "deepseek2":
        config.update(_deepseek(m, config, is_v3))
    return config


def _common(m, meta: Meta, architecture: str, has_output: bool, n_vocab: int) -> dict:
    hidden, heads = _required(m, "embedding_length"), _required(m, "attention.head_count")
    head_kv = m("attention.head_count_kv", heads)
    config = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES[architecture],
        "hidden_size": hidden,
        "intermediate_size": m("feed_forward_length", 0),
        "num_hidden_layers": _required(m, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": head_kv[0] if isinstance(head_kv, list) else head_kv,
        "head_dim": m("attention.key_length", hidden // heads),
        "rms_norm_eps": m("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": m("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(m),
        "vocab_size": m("vocab_size", n_vocab),
        "max_position_embeddings": m("context_length", 4096),
        "tie_word_embeddings": not has_output,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta("tokenizer.ggml.eos_token_id", None),
        "hidden_act": "silu",
    }
    config["rope_parameters"] = _rope_parameters(config["rope_theta"], config["rope_scaling"])
    return config


def _rope_parameters(theta: float, scaling: dict | None) -> dict:
    """transformers 5 spelling of rope_theta + rope_scaling."""
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling:
        params.update({k: v for k, v in scaling.items() if k != "type"})
    return params


_MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def _required(m, key: str):
    value = m(key)
    if value is None:
        raise WeightsError(f"GGUF metadata has no '{key}'")
    return value


def _rope_scaling(m) -> dict | None:
    kind = m("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "type": kind, "factor": m("rope.scaling.factor", 1.0)}
    if m("rope.scaling.original_context_length") is not None:
        scaling["original_max_position_embeddings"] = m("rope.scaling.original_context_length")
    if m("rope.scaling.yarn_log_multiplier") is not None:
        # llama.cpp stores 0.1 * mscale_all_dim (deepseek2 converter)
        mscale = m("rope.scaling.yarn_log_multiplier") / 0.1
        scaling.update(mscale=mscale, mscale_all_dim=mscale)
    for key in ("beta_fast", "beta_slow"):
        if m(f"rope.scaling.yarn_{key}") is not None:
            scaling[key] = m(f"rope.scaling.yarn_{key}")
    return scaling


def _mixtral(m) -> dict:
    return {"num_local_experts": _required(m, "expert_count"),
            "num_experts_per_tok": _required(m, "expert_used_count")}


def _qwen_moe(m, arch: str) -> dict:
    config = {
        "num_experts": _required(m, "expert_count"),
        "num_local_experts": _required(m, "expert_count"),
        "num_experts_per_tok": _required(m, "expert_used_count"),
        "moe_intermediate_size": _required(m, "expert_feed_forward_length"),
        "norm_topk_prob": bool(m("expert_weights_norm", arch == "qwen3moe")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = m("expert_shared_feed_forward_length", 0)
    return config


def _deepseek(m, config: dict, is_v3: bool) -> dict:
    rope_dim = _required(m, "rope.dimension_count")
    key_len_mla, value_len_mla = m("attention.key_length_mla"), m("attention.value_length_mla")
    key_len = key_len_mla if key_len_mla is not None else _required(m, "attention.key_length")
    value_len = value_len_mla if value_len_mla is not None else _required(m, "attention.value_length")
    n_group = m("expert_group_count", 1)
    q_lora = m("attention.q_lora_rank", 0)
    return {
        "num_key_value_heads": config["num_attention_heads"],
        "head_dim": rope_dim,
        "q_lora_rank": q_lora or None,
        "kv_lora_rank": _required(m, "attention.kv_lora_rank"),
        "qk_nope_head_dim": key_len - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": value_len,
        "n_routed_experts": _required(m, "expert_count"),
        "num_experts_per_tok": _required(m, "expert_used_count"),
        "moe_intermediate_size": _required(m, "expert_feed_forward_length"),
        "n_shared_experts": m("expert_shared_count", 0),
        "first_k_dense_replace": m("leading_dense_block_count", 0),
        "routed_scaling_factor": m("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(m("expert_weights_norm", is_v3)),
        "scoring_func": _GATING_FUNCS.get(m("expert_gating_func"), "sigmoid" if is_v3 else "softmax"),
        "n_group": n_group,
        "topk_group": m("expert_group_used_count", 1),
        "topk_method": "noaux_tc" if is_v3 else ("group_limited_greedy" if n_group > 1 else "greedy"),
        "moe_layer_freq": 1,
    }


def check_architecture(arch: str, where) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise WeightsError(f"{where}: unsupported GGUF architecture {arch!r} "
                           f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

