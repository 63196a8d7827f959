"""ModelConfig: the fields kt's models read, parsed from a Hugging Face config dict
(transformers 4 and 5 spellings: rope_scaling/rope_theta or rope_parameters;
num_experts/num_local_experts/n_routed_experts)."""

from dataclasses import dataclass, field

from ..errors import ModelError
from ..layers.rope import RopeSpec


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    shared_intermediate_size: int = 0     # 0: no shared expert
    shared_expert_gate: bool = False      # Qwen2-MoE sigmoid gate on the shared expert
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    routed_scaling_factor: float = 1.0
    dense_layers: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelError(f"num_experts_per_tok={self.top_k} with {self.num_experts} experts")
        if self.intermediate_size <= 0:
            raise ModelError(f"expert intermediate size must be positive, got {self.intermediate_size}")


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers


def get(hf: dict, *names: str, default=None, required: bool = False):
    """The first of `names` present (and not None) in hf."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if required:
        raise ModelError(f"config.json lacks {names[0]}")
    return default


def rope_spec(hf: dict, dim: int, interleaved: bool = False) -> RopeSpec:
    params = dict(get(hf, "rope_parameters", "rope_scaling", default={}) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    max_pos = hf.get("max_position_embeddings", 0)
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings", max_pos))
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / original if kind == "yarn" and original else 1.0
    return RopeSpec(
        dim=dim, theta=float(theta), kind=kind, factor=float(factor),
        original_max_positions=int(original or 0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
        interleaved=interleaved)


def base_fields(hf: dict, architecture: str) -> dict:
    """The fields every decoder-only architecture shares."""
    hidden = get(hf, "hidden_size", required=True)
    heads = get(hf, "num_attention_heads", required=True)
    return dict(
        architecture=architecture,
        vocab_size=get(hf, "vocab_size", required=True),
        hidden_size=hidden,
        intermediate_size=get(hf, "intermediate_size", default=0),
        num_layers=get(hf, "num_hidden_layers", required=True),
        num_heads=heads,
        num_kv_heads=get(hf, "num_key_value_heads", default=heads),
        head_dim=get(hf, "head_dim", default=hidden // heads),
        rms_norm_eps=float(get(hf, "rms_norm_eps", default=1e-6)),
        hidden_act=get(hf, "hidden_act", default="silu"),
        tie_word_embeddings=bool(get(hf, "tie_word_embeddings", default=False)),
        attention_bias=bool(get(hf, "attention_bias", default=False)),
        mlp_bias=bool(get(hf, "mlp_bias", default=False)),
        extra=hf,
    )


def num_experts(hf: dict) -> int:
    return get(hf, "num_experts", "num_local_experts", "n_routed_experts", required=True)


def qwen_dense_layers(hf: dict, num_layers: int) -> frozenset[int]:
    """Qwen-MoE: a layer is dense when listed in mlp_only_layers or off the decoder_sparse_step grid."""
    step = get(hf, "decoder_sparse_step", default=1)
    only = set(get(hf, "mlp_only_layers", default=[]) or [])
    return frozenset(i for i in range(num_layers) if i in only or (i + 1) % step)
