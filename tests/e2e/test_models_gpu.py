"""The torch side on a CUDA GPU (attention, norms, dense MLPs, shared and device
experts) with routed experts on the CPU, against transformers in float32 on the CPU.
Bounds over all rows of a test: tiny_models.host_bounds(dtype), i.e. float32 on the
GPU keeps the float bounds (1e-3, cosine 0.9999, top-1 100%) unless the CPU kernels
round activations to bf16; bfloat16, the GPU default, gets the bf16 bounds."""

import pytest
import torch

from kt_cli.models.registry import ModelOptions, build_model
from kt_weights.checkpoint import open_checkpoint

from tiny_models import PagedDriver, agreement, build_tiny, host_bounds, reference_logits, reference_model

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

KINDS = ("llama", "qwen2_moe", "qwen3_moe", "deepseek_v2_lite", "deepseek_v3")


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
    got = torch.cat([logits[sid] for sid in prompts] + [decode[sid] for sid in prompts])
    want = torch.cat([reference_logits(ref, ids) for ids in prompts.values()]
                     + [reference_logits(ref, ids + [17])[-1:] for ids in prompts.values()])
    bounds = host_bounds(dtype)
    a = agreement(got, want, bounds.top1_margin)
    assert bounds.holds(a), f"{kind} {dtype} placed={placed}: {a} (bounds {bounds})"
