"""The torch side on a CUDA GPU (attention, norms, dense MLPs, shared and device
experts) with routed experts on the CPU, against transformers in float32 on the CPU.
float32 on the GPU keeps the float bounds (1e-3, cosine 0.9999, top-1 100%);
bfloat16, the GPU default, rounds every activation to 8 bits of mantissa, hence
max|diff|/max|ref| < 5e-2, cosine > 0.998 and top-1 >= 90%."""

import pytest
import torch

from kt_cli.models.registry import ModelOptions, build_model
from kt_weights.checkpoint import open_checkpoint

from tiny_models import PagedDriver, agreement, build_tiny, reference_logits, reference_model

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

KINDS = ("llama", "qwen2_moe", "qwen3_moe", "deepseek_v2_lite", "deepseek_v3")
BOUNDS = {torch.float32: (1e-3, 0.9999, 1.0), torch.bfloat16: (5e-2, 0.998, 0.9)}


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    directory = build_tiny(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, directory, reference_model(directory)


def half_on_device(model) -> dict:
    n = model.config.moe.num_experts if model.config.moe else 0
    return {i: tuple(e % 2 == 0 for e in range(n)) for i in range(model.config.num_layers)
            if model.config.is_moe_layer(i)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("placed", [False, True])
def test_gpu_matches_transformers(tiny, dtype, placed):
    kind, directory, ref = tiny
    options = ModelOptions(device="cuda", dtype=dtype)
    if placed:
        probe = build_model(open_checkpoint(directory), options)
        options = ModelOptions(device="cuda", dtype=dtype, device_experts=half_on_device(probe))
    model = build_model(open_checkpoint(directory), options)
    driver = PagedDriver(model, device="cuda")
    prompts = {0: list(range(5, 42)), 1: [3, 9, 27, 81, 243], 2: [11]}
    logits = driver.step(prompts)
    decode = driver.step({sid: [17] for sid in prompts})
    rel, cos, top1 = BOUNDS[dtype]
    for sid, ids in prompts.items():
        for got, want in ((logits[sid], reference_logits(ref, ids)),
                          (decode[sid], reference_logits(ref, ids + [17])[-1:])):
            a = agreement(got, want)
            assert a.rel_max_diff < rel and a.min_cosine > cos and a.top1 >= top1, f"{kind} {dtype}: {a}"
