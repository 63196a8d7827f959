"""Softmax top-k routing on the native kernel (kt.h kt_route_softmax_topk) against a
float64 softmax and torch.topk, with expert counting, ties, NaN logits and the
inputs it refuses."""

import pytest
import torch

from kt_cli.ops.ffi_args import OpError


def _logits(tokens, experts, seed):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("tokens, experts, k", [(1, 8, 2), (5, 60, 4), (40, 128, 8), (3, 64, 64), (7, 16, 1)])
@pytest.mark.parametrize("normalize", [True, False])
def test_picks_and_weighs_like_float64(ops, tokens, experts, k, normalize):
    logits = _logits(tokens, experts, seed=tokens * experts + k)
    weights, ids = ops.softmax_topk(logits, k, normalize)
    probs = logits.double().softmax(-1)
    want_w, want_ids = probs.topk(k, dim=-1)
    if normalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (tokens, k)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights.double(), want_w, rtol=2e-6, atol=1e-7)


def test_counts_accumulate_every_choice(ops):
    counts = torch.zeros(32, dtype=torch.int64)
    chosen = []
    for seed in range(3):
        _, ids = ops.softmax_topk(_logits(9, 32, seed), 4, True, counts)
        chosen.append(ids.flatten().long())
    assert torch.equal(counts, torch.bincount(torch.cat(chosen), minlength=32))


def test_equal_probabilities_keep_the_lower_ids_first(ops):
    weights, ids = ops.softmax_topk(torch.zeros(2, 10), 3, False)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((2, 3), 0.1))


def test_nan_logits_still_give_valid_ids(ops):
    logits = _logits(2, 16, seed=1)
    logits[0, 3] = float("nan")
    counts = torch.zeros(16, dtype=torch.int64)
    _, ids = ops.softmax_topk(logits, 4, True, counts)
    assert ids.min() >= 0 and ids.max() < 16 and int(counts.sum()) == 8


@pytest.mark.parametrize("bad", [
    dict(k=0), dict(k=17), dict(logits=torch.zeros(3, 16, dtype=torch.float64)), dict(logits=torch.zeros(16)),
    dict(logits=torch.zeros(16, 3).t()), dict(counts=torch.zeros(15, dtype=torch.int64)),
    dict(counts=torch.zeros(16, dtype=torch.int32)),
])
def test_refuses_bad_inputs(ops, bad):
    args = dict(logits=torch.zeros(3, 16), k=2, counts=None) | bad
    with pytest.raises(OpError):
        ops.softmax_topk(args["logits"], args["k"], True, args["counts"])


def test_native_check_refuses_k_beyond_its_limit(ops):
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    logits = torch.zeros(1, 128)
    ids, weights = torch.empty(1, 65, dtype=torch.int32), torch.empty(1, 65)
    rc = lib.kt_route_softmax_topk(ffi.cast("float *", logits.data_ptr()), 1, 128, 65, 1,
                                   ffi.cast("int32_t *", ids.data_ptr()), ffi.cast("float *", weights.data_ptr()),
                                   ffi.NULL)
    assert rc == lib.KT_EINVAL
