"""ModelOptions validation and expert placement: experts flagged for the device run
in torch and reach the CPU operator as id -1; the logits must not change. The
checkpoint is float32 so that kt's kernels keep float32 activations on every CPU
(they round them to bf16 only for BF16 weights) and both paths compute alike."""

import pytest
import torch

from kt_cli.errors import ModelError
from kt_cli.models.registry import ModelOptions, build_model
from kt_weights.checkpoint import open_checkpoint

from tiny_models import VOCAB, PagedDriver, agreement, build_tiny


def test_defaults_pick_the_dtype_per_device():
    assert ModelOptions().dtype == torch.float32
    assert ModelOptions(device="cuda:1").dtype == torch.bfloat16
    assert ModelOptions(device="cpu", dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="gpu"), "device must be 'cpu' or 'cuda"),
    (dict(device="cuda:x"), "device must be 'cpu' or 'cuda"),
    (dict(dtype=torch.int8), "compute dtype torch.int8 unsupported"),
])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ModelError, match=message):
        ModelOptions(**kwargs)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_tiny("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), dtype=torch.float32)


def test_wrong_placement_mask_length_is_refused(qwen3_dir):
    with pytest.raises(ModelError, match="placement mask has 3 entries for 16 experts"):
        build_model(open_checkpoint(qwen3_dir), ModelOptions(device_experts={0: (True, False, True)}))


def test_device_experts_give_the_same_logits(qwen3_dir):
    mask = tuple(e % 3 == 0 for e in range(16))
    placed = build_model(open_checkpoint(qwen3_dir), ModelOptions(device_experts={0: mask, 1: mask}))
    plain = build_model(open_checkpoint(qwen3_dir), ModelOptions())
    seen = spy_cpu_ids(placed.layers[0].mlp)
    prompts = {0: list(range(3, 40)), 1: [7, 1, 200]}
    got, ref = PagedDriver(placed).step(prompts), PagedDriver(plain).step(prompts)
    ids = torch.cat(seen)
    assert (ids == -1).any() and not torch.isin(ids, torch.tensor([e for e in range(16) if mask[e]])).any()
    for sid in prompts:
        a = agreement(got[sid], ref[sid])
        assert a.rel_max_diff < 1e-5 and a.top1 == 1.0, str(a)
        assert got[sid].shape == (len(prompts[sid]), VOCAB)


def spy_cpu_ids(block) -> list:
    seen, submit = [], block.cpu.submit

    def recording_submit(x, ids, weights):
        seen.append(ids.clone())
        return submit(x, ids, weights)
    block.cpu.submit = recording_submit
    return seen
