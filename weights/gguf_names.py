"""GGUF tensor names -> Hugging Face names, one literal map per GGUF
architecture. `{L}` is the layer, `{E}` the expert. Expert tensors stored 3-D in
GGUF (`ffn_*_exps`) expand to one HF name per expert."""

_LLAMA_ATTENTION = {
    "blk.{L}.attn_norm.weight": "model.layers.{L}.input_layernorm.weight",
    "blk.{L}.attn_q.weight": "model.layers.{L}.self_attn.q_proj.weight",
    "blk.{L}.attn_k.weight": "model.layers.{L}.self_attn.k_proj.weight",
    "blk.{L}.attn_v.weight": "model.layers.{L}.self_attn.v_proj.weight",
    "blk.{L}.attn_output.weight": "model.layers.{L}.self_attn.o_proj.weight",
    "blk.{L}.ffn_norm.weight": "model.layers.{L}.post_attention_layernorm.weight",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_DENSE_MLP = {
    "blk.{L}.ffn_gate.weight": "model.layers.{L}.mlp.gate_proj.weight",
    "blk.{L}.ffn_up.weight": "model.layers.{L}.mlp.up_proj.weight",
    "blk.{L}.ffn_down.weight": "model.layers.{L}.mlp.down_proj.weight",
}
_QWEN_ATTENTION_BIAS = {
    "blk.{L}.attn_q.bias": "model.layers.{L}.self_attn.q_proj.bias",
    "blk.{L}.attn_k.bias": "model.layers.{L}.self_attn.k_proj.bias",
    "blk.{L}.attn_v.bias": "model.layers.{L}.self_attn.v_proj.bias",
}

WEIGHT_MAPS = {
    "llama": {
        **_GLOBAL, **_LLAMA_ATTENTION, **_DENSE_MLP,
        "blk.{L}.ffn_gate_inp.weight": "model.layers.{L}.block_sparse_moe.gate.weight",
    },
    "qwen2moe": {
        **_GLOBAL, **_LLAMA_ATTENTION, **_QWEN_ATTENTION_BIAS,
        "blk.{L}.ffn_gate_inp.weight": "model.layers.{L}.mlp.gate.weight",
        "blk.{L}.ffn_gate_inp_shexp.weight": "model.layers.{L}.mlp.shared_expert_gate.weight",
        "blk.{L}.ffn_gate_shexp.weight": "model.layers.{L}.mlp.shared_expert.gate_proj.weight",
        "blk.{L}.ffn_up_shexp.weight": "model.layers.{L}.mlp.shared_expert.up_proj.weight",
        "blk.{L}.ffn_down_shexp.weight": "model.layers.{L}.mlp.shared_expert.down_proj.weight",
    },
    "qwen3moe": {
        **_GLOBAL, **_LLAMA_ATTENTION,
        "blk.{L}.attn_q_norm.weight": "model.layers.{L}.self_attn.q_norm.weight",
        "blk.{L}.attn_k_norm.weight": "model.layers.{L}.self_attn.k_norm.weight",
        "blk.{L}.ffn_gate_inp.weight": "model.layers.{L}.mlp.gate.weight",
    },
    "deepseek2": {
        **_GLOBAL, **_DENSE_MLP,
        "blk.{L}.attn_norm.weight": "model.layers.{L}.input_layernorm.weight",
        "blk.{L}.attn_q.weight": "model.layers.{L}.self_attn.q_proj.weight",
        "blk.{L}.attn_q_a.weight": "model.layers.{L}.self_attn.q_a_proj.weight",
        "blk.{L}.attn_q_a_norm.weight": "model.layers.{L}.self_attn.q_a_layernorm.weight",
        "blk.{L}.attn_q_b.weight": "model.layers.{L}.self_attn.q_b_proj.weight",
        "blk.{L}.attn_kv_a_mqa.weight": "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
        "blk.{L}.attn_kv_a_norm.weight": "model.layers.{L}.self_attn.kv_a_layernorm.weight",
        "blk.{L}.attn_kv_b.weight": "model.layers.{L}.self_attn.kv_b_proj.weight",
        "blk.{L}.attn_output.weight": "model.layers.{L}.self_attn.o_proj.weight",
        "blk.{L}.ffn_norm.weight": "model.layers.{L}.post_attention_layernorm.weight",
        "blk.{L}.ffn_gate_inp.weight": "model.layers.{L}.mlp.gate.weight",
        "blk.{L}.exp_probs_b.bias": "model.layers.{L}.mlp.gate.e_score_correction_bias",
        "blk.{L}.ffn_gate_shexp.weight": "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
        "blk.{L}.ffn_up_shexp.weight": "model.layers.{L}.mlp.shared_experts.up_proj.weight",
        "blk.{L}.ffn_down_shexp.weight": "model.layers.{L}.mlp.shared_experts.down_proj.weight",
    },
}

EXPERT_TENSORS = {"gate": "blk.{L}.ffn_gate_exps.weight", "up": "blk.{L}.ffn_up_exps.weight",
                  "down": "blk.{L}.ffn_down_exps.weight"}

EXPERT_NAMES = {
    "llama": {"gate": "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
              "up": "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
              "down": "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight"},
    **{arch: {proj: f"model.layers.{{L}}.mlp.experts.{{E}}.{proj}_proj.weight"
              for proj in ("gate", "up", "down")}
       for arch in ("qwen2moe", "qwen3moe", "deepseek2")},
}

# newer deepseek2 GGUFs split kv_b_proj into per-head k_b (transposed) and v_b
MLA_SPLIT = {"k_b": "blk.{L}.attn_k_b.weight", "v_b": "blk.{L}.attn_v_b.weight"}
KV_B_NAME = "model.layers.{L}.self_attn.kv_b_proj.weight"

# llama.cpp's converter reorders the rows of q/k for the llama architecture
PERMUTED_ROWS = {"llama": {"attn_q.weight": "head_count", "attn_k.weight": "head_count_kv"}}


def hf_name(arch: str, gguf_name: str) -> str | None:
    mapping = WEIGHT_MAPS[arch]
    if gguf_name in mapping:
        return mapping[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        template = mapping.get(f"blk.{{L}}.{parts[2]}")
        return template.format(L=parts[1]) if template else None
    return None
