"""GGUF metadata from a HF config.json and tokenizer files: the keys llama.cpp's
loader reads for each supported architecture (learned from llama.cpp's
convert_hf_to_gguf.py; written here with gguf's GGUFWriter helpers)."""

from pathlib import Path

import gguf

from ..errors import WeightsError

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
             "Qwen3MoeForCausalLM": "qwen3moe", "DeepseekV2ForCausalLM": "deepseek2",
             "DeepseekV3ForCausalLM": "deepseek2"}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}
# llama.cpp picks its pre-tokenizer regex by this name; by model family
PRE_TOKENIZERS = {"llama": "llama-bpe", "qwen2_moe": "qwen2", "qwen3_moe": "qwen2",
                  "deepseek_v2": "deepseek-llm", "deepseek_v3": "deepseek-v3"}


def rope_params(config: dict) -> dict:
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def add_model_metadata(w: gguf.GGUFWriter, arch: str, c: dict, name: str, gguf_type: str) -> None:
    w.add_name(name)
    w.add_file_type(FILE_TYPES[gguf_type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c.get("max_position_embeddings", 4096))
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(1 if arch == "deepseek2" else c.get("num_key_value_heads", c["num_attention_heads"]))
    w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(float(rope_params(c)["rope_theta"]))
    w.add_vocab_size(c["vocab_size"])
    _add_experts(w, arch, c)
    {"llama": _llama, "qwen2moe": _qwen_moe, "qwen3moe": _qwen_moe, "deepseek2": _deepseek2}[arch](w, arch, c)


def _add_experts(w: gguf.GGUFWriter, arch: str, c: dict) -> None:
    n = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
    if n:
        w.add_expert_count(n)
        w.add_expert_used_count(c["num_experts_per_tok"])


def _llama(w: gguf.GGUFWriter, arch: str, c: dict) -> None:
    w.add_rope_dimension_count(head_dim(c))
    if c.get("head_dim"):
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    rope = rope_params(c)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        _add_yarn(w, arch, rope)


def _qwen_moe(w: gguf.GGUFWriter, arch: str, c: dict) -> None:
    if arch == "qwen2moe" and (c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1):
        raise WeightsError("qwen2moe GGUF: llama.cpp's qwen2moe has no dense layers "
                           "(config has mlp_only_layers / decoder_sparse_step)")
    if c.get("head_dim"):
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if "norm_topk_prob" in c:
        w.add_expert_weights_norm(bool(c["norm_topk_prob"]))


def _deepseek2(w: gguf.GGUFWriter, arch: str, c: dict) -> None:
    rope_dim, kv_lora = c["qk_rope_head_dim"], c["kv_lora_rank"]
    w.add_leading_dense_block_count(c.get("first_k_dense_replace", 0))
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope_dim)            # MLA as MQA over the compressed cache
    w.add_value_length(kv_lora)
    w.add_key_length_mla(c["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(c["v_head_dim"])
    w.add_rope_dimension_count(rope_dim)
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c.get("n_shared_experts") or 0)
    w.add_expert_weights_scale(float(c.get("routed_scaling_factor", 1.0)))
    w.add_expert_weights_norm(bool(c.get("norm_topk_prob", False)))
    sigmoid = c.get("scoring_func", "sigmoid" if c.get("model_type") == "deepseek_v3" else "softmax") == "sigmoid"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if c.get("n_group"):
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c.get("topk_group", 1))
    rope = rope_params(c)
    if rope["rope_type"] == "yarn":
        _add_yarn(w, arch, rope)
        if rope.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _add_yarn(w: gguf.GGUFWriter, arch: str, rope: dict) -> None:
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    if rope.get("original_max_position_embeddings"):
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key in ("beta_fast", "beta_slow"):
        if rope.get(key) is not None:
            w.add_float32(f"{arch}.rope.scaling.yarn_{key}", float(rope[key]))


def add_tokenizer(w: gguf.GGUFWriter, directory: Path, config: dict) -> str | None:
    """Tokens, types, merges, special ids and chat template from the HF tokenizer
    files. -> a note when there is nothing to convert."""
    if not (directory / "tokenizer.json").is_file():
        return "no tokenizer.json in the source: the GGUF has no vocabulary"
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:
        raise WeightsError(f"{directory}: cannot load the tokenizer ({err})") from None
    if getattr(tok, "is_fast", False) and _byte_fallback(tok):
        return _add_llama_vocab(w, directory)
    tokens, types = _gpt2_tokens(tok, config["vocab_size"], directory)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZERS.get(config.get("model_type"), "default"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(directory, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    return None


def _gpt2_tokens(tok, vocab_size: int, directory: Path) -> tuple[list[str], list[int]]:
    vocab = tok.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise WeightsError(f"{directory}: the tokenizer has ids up to {max(vocab.values())}, "
                           f"beyond vocab_size {vocab_size}")
    by_id = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else
                         gguf.TokenType.USER_DEFINED if by_id[i] in added else gguf.TokenType.NORMAL)
    return tokens, types


def _byte_fallback(tok) -> bool:
    import json

    model = json.loads(tok.backend_tokenizer.to_str()).get("model", {})
    return bool(model.get("byte_fallback"))


def _add_llama_vocab(w: gguf.GGUFWriter, directory: Path) -> None:
    vocab = gguf.vocab.LlamaHfVocab(directory)
    tokens, scores, types = zip(*vocab.all_tokens())
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(tokens))
    w.add_token_scores(list(scores))
    w.add_token_types(list(types))
    gguf.SpecialVocab(directory, load_merges=False, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    return None
