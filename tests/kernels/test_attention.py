"""kt_attention_decode_f32 (ops.paged_attention) on each variant against attention
computed in float64 from the gathered cache rows: GQA groups, paged (scattered)
contexts of lengths around the kernel's 32-key blocks, several rows in one call,
head dims that are not a multiple of the vector width, and scores far apart (the
online softmax rescaling what it summed when a later block holds the maximum).
Prefill rows (Contexts.causal: a sequence's new rows share a context start, causal
through their lengths) run the kernel's blocked path: row counts around its blocks,
groups from 1 to 40 heads, a chunk after earlier context, and a decode row beside
a prefill chunk in one call. Long decode rows split into pieces for several threads
(each piece's running maximum, sum and values merged at the end): contexts of
hundreds to thousands of keys, and scores rising along them so that the last piece
holds the maximum.

Bound: 2e-5 relative to the largest output (float32 scores and exp; the value sums
of up to a few thousand terms, measured below 2e-6)."""

import pytest
import torch

from kt_cli.errors import KtError
from kt_cli.ops import Contexts

BOUND = 2e-5


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference(q, k_cache, v_cache, per_row, scale):
    out = []
    for i, slots in enumerate(per_row):
        k = k_cache.double()[slots].transpose(0, 1)       # [Hkv, L, D]
        v = v_cache.double()[slots].transpose(0, 1)
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        probs = (scale * q[i].double()[:, None, :] @ k.transpose(1, 2)).softmax(-1)    # [H, 1, L]
        out.append((probs @ v)[:, 0])
    return torch.stack(out)


def _close(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert err < BOUND, err


def _scattered(rows: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    return [perm[sum(lengths[:i]):sum(lengths[:i + 1])] for i in range(len(lengths))]


@pytest.mark.parametrize("heads, kv_heads, dim, v_dim", [(32, 4, 128, 128), (9, 3, 64, 64), (4, 4, 20, 12),
                                                         (2, 1, 7, 9)])
@pytest.mark.parametrize("lengths", [[1], [31, 32, 33], [5, 200, 1]])
def test_matches_float64(ops, heads, kv_heads, dim, v_dim, lengths):
    _check_decode_rows(ops, (heads, kv_heads, dim, v_dim), lengths, rows=512, seed=1)


def _check_decode_rows(ops, shape, lengths, rows, seed):
    """one decode row a context of lengths, scattered over a cache of `rows`, vs float64"""
    heads, kv_heads, dim, v_dim = shape
    q = _randn(len(lengths), heads, dim, seed=seed)
    k_cache, v_cache = _randn(rows, kv_heads, dim, seed=seed + 1), _randn(rows, kv_heads, v_dim, seed=seed + 2)
    per_row = _scattered(rows, lengths, seed=seed + 3)
    scale = dim ** -0.5
    got = ops.paged_attention(q, k_cache, v_cache, Contexts.of(per_row), scale)
    _close(got, _reference(q, k_cache, v_cache, per_row, scale))


def test_rows_may_share_context(ops):
    """Two rows over overlapping contexts (a sequence's prefix read twice)."""
    q, k_cache, v_cache = _randn(2, 8, 16, seed=5), _randn(100, 2, 16, seed=6), _randn(100, 2, 16, seed=7)
    per_row = [torch.arange(0, 60), torch.arange(0, 61)]
    _close(ops.paged_attention(q, k_cache, v_cache, Contexts.of(per_row), 0.25),
           _reference(q, k_cache, v_cache, per_row, 0.25))


def test_late_maximum_rescales_earlier_blocks(ops):
    """Scores in the hundreds, rising along the context: every block raises the running
    maximum, and a naive exp would overflow."""
    _check_rising_scores(ops, torch.ones(1, 2, 16), length=300, top=40.0, seed=8)


def _check_rising_scores(ops, q, length, top, seed):
    """one decode row of q over keys rising from 0 to `top` in every element (one KV head), vs float64"""
    k_cache = torch.linspace(0, top, length)[:, None, None].expand(length, 1, q.shape[2]).contiguous()
    v_cache = _randn(length, 1, 8, seed=seed)
    per_row = [torch.arange(length)]
    got = ops.paged_attention(q, k_cache, v_cache, Contexts.of(per_row), 1.0)
    assert torch.isfinite(got).all()
    _close(got, _reference(q, k_cache, v_cache, per_row, 1.0))


@pytest.mark.parametrize("heads, kv_heads, dim, v_dim", [(32, 4, 128, 128), (16, 1, 64, 48), (8, 8, 16, 16),
                                                         (12, 3, 24, 24)])
@pytest.mark.parametrize("lengths", [[2000], [1, 700, 1500, 33], [257, 256, 255]])
def test_long_decode_rows_split_into_pieces(ops, heads, kv_heads, dim, v_dim, lengths):
    _check_decode_rows(ops, (heads, kv_heads, dim, v_dim), lengths, rows=4000, seed=21)


def test_split_row_merges_a_late_maximum(ops):
    """Scores rising to 1200 along a 1500-key context: the pieces' maxima differ by hundreds, so
    merging their sums unscaled overflows or weights the early pieces wrongly. Each score is one
    exact product (16 times a key's first element)."""
    q = torch.zeros(1, 8, 16)
    q[..., 0] = 16.0
    _check_rising_scores(ops, q, length=1500, top=75.0, seed=25)


def _causal_per_row(slots: list[torch.Tensor], new: list[int]) -> list[torch.Tensor]:
    """each sequence's new rows as the reference sees them: row j of k reads the first L - k + 1 + j slots"""
    return [s[:s.numel() - k + 1 + j] for s, k in zip(slots, new) for j in range(k)]


def _causal(slots: list[torch.Tensor], new: list[int]) -> Contexts:
    return Contexts.causal(slots, new)


@pytest.mark.parametrize("heads, kv_heads, dim, v_dim", [(32, 4, 128, 128), (9, 3, 64, 64), (4, 4, 20, 12),
                                                         (2, 1, 7, 9), (40, 1, 16, 16), (6, 2, 33, 8)])
@pytest.mark.parametrize("lengths, new", [([1], [1]), ([37], [37]), ([130], [130]), ([200], [70]),
                                          ([64, 1, 50], [64, 1, 3]), ([5, 300], [1, 97])])
def test_prefill_rows_match_float64(ops, heads, kv_heads, dim, v_dim, lengths, new):
    rows = 600
    k_cache, v_cache = _randn(rows, kv_heads, dim, seed=12), _randn(rows, kv_heads, v_dim, seed=13)
    slots = _scattered(rows, lengths, seed=14)
    q = _randn(sum(new), heads, dim, seed=15)
    scale = dim ** -0.5
    got = ops.paged_attention(q, k_cache, v_cache, _causal(slots, new), scale)
    _close(got, _reference(q, k_cache, v_cache, _causal_per_row(slots, new), scale))


def test_prefill_late_maximum_rescales_every_row(ops):
    """Scores rising to 640 along a long prompt: every block raises each row's running maximum,
    and a naive exp would overflow. Each score is one exact product (16 times a key's first
    element), so float32 sums of scores this large, whose rounding alone moves exp by ~1e-5,
    play no part: what is checked is the rescaling."""
    dim, length = 16, 300
    q = torch.zeros(length, 8, dim)
    q[..., 0] = 16.0
    k_cache = torch.linspace(0, 40, length)[:, None, None].expand(length, 2, dim).contiguous()
    v_cache = _randn(length, 2, 8, seed=16)
    slots = [torch.arange(length)]
    got = ops.paged_attention(q, k_cache, v_cache, _causal(slots, [length]), 1.0)
    assert torch.isfinite(got).all()
    _close(got, _reference(q, k_cache, v_cache, _causal_per_row(slots, [length]), 1.0))


def test_causal_contexts_refuse_more_rows_than_context():
    with pytest.raises(KtError, match="3 new rows in a context of 2"):
        Contexts.causal([torch.arange(2)], [3])


def _inputs():
    return torch.ones(1, 4, 8), torch.ones(10, 2, 8), torch.ones(10, 2, 8)


@pytest.mark.parametrize("change, message", [
    (lambda a: dict(a, slots=torch.tensor([3, 10])), "invalid sizes"),
    (lambda a: dict(a, slots=torch.tensor([-1, 2])), "invalid sizes"),
    (lambda a: dict(a, length=torch.tensor([3])), "invalid sizes"),
    (lambda a: dict(a, length=torch.tensor([0])), "invalid sizes"),
    (lambda a: dict(a, offset=torch.tensor([0, 0])), "2 context offsets for 1 lengths"),
    (lambda a: dict(a, offset=torch.tensor([0, 0]), length=torch.tensor([1, 1])), "contexts for 2"),
    (lambda a: dict(a, q=torch.ones(1, 3, 8)), "do not fit"),
    (lambda a: dict(a, q=torch.ones(1, 4, 7)), "do not fit"),
    (lambda a: dict(a, v=torch.ones(9, 2, 8)), "do not fit"),
    (lambda a: dict(a, q=torch.ones(1, 4, 8, dtype=torch.float64)), "float32"),
    (lambda a: dict(a, k=torch.ones(10, 8, 2).transpose(1, 2)), "contiguous"),
    (lambda a: dict(a, slots=torch.tensor([1, 2], dtype=torch.int32)), "int64"),
    (lambda a: dict(a, scale=float("nan")), "invalid sizes"),
    (lambda a: dict(a, scale=1), "scale"),
])
def test_bad_inputs_are_refused(ops, change, message):
    q, k, v = _inputs()
    args = change(dict(q=q, k=k, v=v, slots=torch.tensor([1, 2]), offset=torch.tensor([0]),
                       length=torch.tensor([2]), scale=0.5))
    with pytest.raises(KtError, match=message):
        contexts = Contexts(args["slots"], args["offset"], args["length"])
        ops.paged_attention(args["q"], args["k"], args["v"], contexts, args["scale"])
