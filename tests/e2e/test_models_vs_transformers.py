"""kt's models against transformers' own implementation of each architecture.

Each tiny random checkpoint is saved by transformers in bfloat16; transformers runs
it in float32 (the reference) and kt loads the same files through open_checkpoint +
build_model. Bounds over all rows of a check (tiny_models.host_bounds): with float32
activations max|diff| / max|ref| < 1e-3, per-row cosine > 0.9999, top-1 100%
(measured ~1e-6, cosine 1.000000); with activations rounded to bf16 (compute dtype
bfloat16, or CPU kernels with a bf16 dot product: avx512_bf16, amx) >= 80% of rows
above cosine 0.999, none below 0.8, top-1 >= 90% (tiny_models.BF16_ACTIVATIONS)."""

import json

import pytest
import torch
from safetensors import safe_open

from kt_cli.errors import ModelError
from kt_cli.layers.mla import MLADims
from kt_cli.models.registry import SUPPORTED, ModelOptions, build_model
from kt_weights.checkpoint import open_checkpoint

from tiny_models import (TINY_CONFIGS, VOCAB, Bounds, PagedDriver, agreement, build_tiny, host_bounds,
                         reference_logits, reference_model, write_fp8_copy)

PROMPT_LENGTHS = (5, 37, 12, 1)     # 37 > the MLA threshold of the tiny DeepSeeks: expanded form


def assert_close(pairs: list[tuple[torch.Tensor, torch.Tensor]], what: str, bounds: Bounds | None = None) -> None:
    """pairs of (kt logits, reference logits), judged together over all their rows"""
    bounds = bounds or host_bounds()
    a = agreement(torch.cat([g for g, _ in pairs]), torch.cat([r for _, r in pairs]), bounds.top1_margin)
    assert bounds.holds(a), f"{what}: {a} (bounds {bounds})"


def random_prompts(seed: int, lengths=PROMPT_LENGTHS) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {i: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for i, n in enumerate(lengths)}


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    directory = build_tiny(request.param, tmp_path_factory.mktemp(request.param))
    model = build_model(open_checkpoint(directory), ModelOptions())
    return request.param, directory, model, reference_model(directory)


def test_architecture_is_the_registered_class(tiny):
    kind, directory, model, _ = tiny
    architecture = json.loads((directory / "config.json").read_text())["architectures"][0]
    assert type(model) is SUPPORTED[architecture]
    assert len(model.kv_specs()) == model.config.num_layers


def test_prefill_batch_of_different_lengths(tiny):
    kind, _, model, ref = tiny
    prompts = random_prompts(1)
    logits = PagedDriver(model).step(prompts)
    assert all(logits[sid].shape == (len(ids), VOCAB) for sid, ids in prompts.items())
    assert_close([(logits[sid], reference_logits(ref, ids)) for sid, ids in prompts.items()],
                 f"{kind} prefill of {len(prompts)} prompts")


def test_bfloat16_compute_stays_close(tiny):
    kind, directory, _, ref = tiny
    model = build_model(open_checkpoint(directory), ModelOptions(dtype=torch.bfloat16))
    prompts = random_prompts(1)
    logits = PagedDriver(model).step(prompts)
    assert_close([(logits[sid], reference_logits(ref, ids)) for sid, ids in prompts.items()],
                 f"{kind} bf16 prefill", host_bounds(torch.bfloat16))


def test_decode_and_chunked_prefill_from_cache(tiny):
    """Step 1 prefills two prompts and the first chunk of a third; step 2 mixes two
    decode steps with the third prompt's second chunk; step 3 decodes all three."""
    kind, _, model, ref = tiny
    prompts = random_prompts(2, lengths=(9, 4, 21))
    driver = PagedDriver(model, seed=3)
    seqs = {0: prompts[0], 1: prompts[1], 2: prompts[2][:8]}
    driver.step(seqs)
    pairs = []
    for step in (2, 3):
        chunks = {sid: [greedy(ref, ids)] for sid, ids in seqs.items() if sid != 2 or step == 3}
        if step == 2:
            chunks[2] = prompts[2][8:]
        logits = driver.step(chunks)
        for sid, new in chunks.items():
            seqs[sid] = seqs[sid] + new
            pairs.append((logits[sid], reference_logits(ref, seqs[sid])[-len(new):]))
    assert_close(pairs, f"{kind} decode and chunked prefill")


def greedy(ref, ids: list[int]) -> int:
    return int(reference_logits(ref, ids)[-1].argmax())


@pytest.mark.parametrize("kind", [k for k in TINY_CONFIGS if k.startswith("deepseek")])
def test_mla_prompts_cover_both_attention_forms(kind):
    c = TINY_CONFIGS[kind][1]
    dims = MLADims(c["num_attention_heads"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                   c["v_head_dim"])
    assert dims.absorbed_is_cheaper(1) and dims.absorbed_is_cheaper(min(PROMPT_LENGTHS))
    assert not dims.absorbed_is_cheaper(max(PROMPT_LENGTHS))


def test_unknown_architecture_is_refused(tmp_path):
    directory = build_tiny("llama_tied", tmp_path / "llama")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, architectures=["FooForCausalLM"])))
    with pytest.raises(ModelError, match=r"^unsupported architecture FooForCausalLM; supported: .*LlamaForCausalLM"):
        build_model(open_checkpoint(directory), ModelOptions())


def test_fp8_deepseek_v3_matches_transformers_on_dequantized_weights(tmp_path):
    """FP8 e4m3 projections with 128x128 block scales, as DeepSeek-V3 ships them.
    kt's checkpoint reader dequantizes FP8 to bfloat16 (one more rounding than the
    float32 reference), hence at least 1e-2 / cosine 0.9995."""
    bf16_dir = build_tiny("deepseek_v3_fp8", tmp_path / "bf16", seed=5)
    write_fp8_copy(bf16_dir, tmp_path / "fp8", tmp_path / "dequant")
    assert_really_fp8(tmp_path / "fp8" / "model.safetensors")
    ckpt = open_checkpoint(tmp_path / "fp8")
    model = build_model(ckpt, ModelOptions())
    ref = reference_model(tmp_path / "dequant")
    prompts = random_prompts(4, lengths=(11, 3))
    logits = PagedDriver(model).step(prompts)
    host = host_bounds()
    bounds = Bounds(max(host.rel, 1e-2), min(host.cosine, 0.9995), host.close_rows, host.top1, host.top1_margin)
    assert_close([(logits[sid], reference_logits(ref, ids)) for sid, ids in prompts.items()], "fp8", bounds)


def assert_really_fp8(path) -> None:
    """Guards the test above against comparing two identical bf16 models."""
    with safe_open(path, "pt") as f:
        name = "model.layers.1.self_attn.kv_b_proj.weight"
        assert f.get_tensor(name).dtype == torch.float8_e4m3fn
        assert tuple(f.get_tensor(name + "_scale_inv").shape) == (3, 2)     # 288 x 144 in 128-blocks
