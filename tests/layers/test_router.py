"""Router logits on both paths (kt's float32 kernel for decode-sized inputs, torch.mm for
larger ones) against float64, and the experts a softmax top-k router picks from them
against a float64 reference."""

import pytest
import torch

from kt_cli.layers.router import RouterLogits, SoftmaxTopK


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tokens", [1, 3, 15, 16, 40])
def test_logits_match_float64(tokens):
    w, x = _randn(128, 2048, seed=1) / 45, _randn(tokens, 2048, seed=2)
    got = RouterLogits(w)(x)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (tokens, 128)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_softmax_topk_picks_the_float64_experts():
    w, x = _randn(64, 512, seed=3) / 23, _randn(9, 512, seed=4)
    weights, ids = SoftmaxTopK(w, top_k=4, normalize=True).forward(x)
    probs = (x.double() @ w.double().t()).softmax(-1)
    want_w, want_ids = probs.topk(4, dim=-1)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights.double(), want_w / want_w.sum(-1, keepdim=True), rtol=1e-5, atol=0)
