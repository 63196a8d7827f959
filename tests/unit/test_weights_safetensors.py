"""Hugging Face safetensors directories written by transformers' save_pretrained
(single file and sharded), read back through the Checkpoint API and compared with
the model's own state_dict."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from kt_weights.checkpoint import open_checkpoint
from kt_weights.errors import WeightsError
from kt_weights.layout import Format

_COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, intermediate_size=48)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_COMMON, intermediate_size=48, moe_intermediate_size=16, head_dim=8,
                       num_experts=4, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
}


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, kwargs = MODELS[kind]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.to(torch.bfloat16).eval()


def per_expert_reference(kind: str, state: dict) -> dict[str, torch.Tensor]:
    """The in-memory state_dict (fused experts) under the per-expert names the
    files carry. transformers' fused gate_up_proj is [E, 2I, H] with gate first."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[_expert_name(kind, prefix, e, "gate")] = t[e, :half]
                out[_expert_name(kind, prefix, e, "up")] = t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[_expert_name(kind, prefix, e, "down")] = t[e]
        elif kind == "mixtral" and name.endswith("mlp.gate.weight"):
            out[name.replace("mlp.gate", "block_sparse_moe.gate")] = t
        else:
            out[name] = t
    return out


def _expert_name(kind: str, prefix: str, e: int, proj: str) -> str:
    if kind == "mixtral":
        w = {"gate": "w1", "up": "w3", "down": "w2"}[proj]
        return prefix.replace("mlp.experts.", f"block_sparse_moe.experts.{e}.{w}.weight")
    return f"{prefix}{e}.{proj}_proj.weight"


@pytest.fixture(scope="module", params=[(k, s) for k in MODELS for s in (False, True)],
                ids=lambda p: f"{p[0]}{'-sharded' if p[1] else ''}")
def saved(request, tmp_path_factory):
    kind, sharded = request.param
    model = build(kind)
    directory = tmp_path_factory.mktemp(kind)
    model.save_pretrained(directory, max_shard_size="8KB" if sharded else "1GB")
    assert (directory / "model.safetensors.index.json").exists() == sharded
    with open_checkpoint(directory) as ckpt:
        yield kind, ckpt, per_expert_reference(kind, model.state_dict())


def test_every_tensor_equals_the_state_dict(saved):
    kind, ckpt, reference = saved
    assert set(ckpt.names()) == set(reference)
    for name in ckpt.names():
        got = ckpt.tensor(name)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, reference[name].float(), rtol=0, atol=0, msg=name)


def test_architecture_and_config(saved):
    kind, ckpt, _ = saved
    assert ckpt.architecture == MODELS[kind][1]
    assert ckpt.config["hidden_size"] == 32


def test_matrices_are_bf16_views(saved):
    _, ckpt, reference = saved
    name = "model.layers.1.self_attn.q_proj.weight"
    a, b = ckpt.matrix(name), ckpt.matrix(name)
    assert (a.format, a.rows, a.cols) == (Format.BF16, 32, 32)
    assert a.data.data_ptr() == b.data.data_ptr(), "matrix() copied the data"
    assert torch.equal(a.data, reference[name])


def test_experts_match_per_expert_weights(saved):
    kind, ckpt, reference = saved
    if kind == "llama":
        with pytest.raises(WeightsError, match="no routed experts"):
            ckpt.experts(1, "gate")
        return
    for proj in ("gate", "up", "down"):
        experts = ckpt.experts(1, proj)
        assert len(experts) == 4
        for e, m in enumerate(experts):
            expected = reference[_expert_name(kind, "model.layers.1.mlp.experts.", e, proj)]
            assert m.format == Format.BF16 and torch.equal(m.data, expected)
            assert (m.rows, m.cols) == tuple(expected.shape)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_fused_expert_tensors_resolve_like_per_expert_ones(kind, tmp_path):
    model = build(kind, seed=1)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    config = dict(model.config.to_dict(), architectures=[MODELS[kind][1]])
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = per_expert_reference(kind, state)
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.has("model.layers.0.mlp.experts.gate_up_proj")
        for proj in ("gate", "up", "down"):
            for e, m in enumerate(ckpt.experts(0, proj)):
                assert torch.equal(m.data, reference[_expert_name(kind, "model.layers.0.mlp.experts.", e, proj)])
