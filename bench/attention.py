"""The attention-side kernels against the torch code they replace, in one run:
- decode attention over the paged cache: kt_attention_decode_f32 vs torch's bmm + softmax
  + bmm, on a view of the cache when the slots are in order, on a gathered copy when not;
- prefill attention: kt_attention_decode_f32 on the rows' causal contexts vs torch's SDPA
  (GQA, then MLA's expanded form);
- rotary embedding: kt_rope_f32 in place vs torch's expression.
Prints us per call (median of 5 rounds) and the ratio.

    python bench/attention.py [--heads 32] [--kv-heads 4] [--dim 128] [--contexts 64 512 2048]
"""

import argparse
import statistics
import time

import kt_cli  # noqa: F401  before torch: it sets GOMP_SPINCOUNT, which libgomp reads as torch loads
import torch
import torch.nn.functional as F

from kt_cli import ops
from kt_cli.layers.attention import _attend_one_query
from kt_cli.layers.rope import RopeSpec, Rotary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--contexts", type=int, nargs="*", default=[64, 512, 2048])
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the prefill rows")
    parser.add_argument("--mla-heads", type=int, default=16, help="heads of the MLA prefill row")
    return parser.parse_args()


def microseconds(fn, repeats: int) -> float:
    """median of 5 rounds of `repeats` calls"""
    fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        rounds.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(rounds)


def row(name: str, kt_us: float, torch_us: float) -> None:
    print(f"{name:34s} {kt_us:10.1f} {torch_us:10.1f} {torch_us / kt_us:8.2f}x")


def decode_rows(args) -> None:
    rows = max(args.contexts) + 64
    q = torch.randn(1, args.heads, args.dim)
    k, v = torch.randn(rows, args.kv_heads, args.dim), torch.randn(rows, args.kv_heads, args.dim)
    scale = args.dim ** -0.5
    for n in args.contexts:
        repeats = max(3, 20000 // n)
        scattered = torch.randperm(rows)[:n].sort().values     # a sequence's blocks spread over the pool
        for name, slots, gather in (("in order", torch.arange(n), lambda t: t[:n]),
                                    ("scattered", scattered, lambda t: t.index_select(0, scattered))):
            contexts = ops.Contexts.of([slots])
            kt = microseconds(lambda: ops.paged_attention(q, k, v, contexts, scale), repeats)
            ref = microseconds(lambda: _attend_one_query(q, gather(k), gather(v), scale), repeats)
            row(f"decode attention, {n} {name}", kt, ref)


def prefill_rows(args) -> None:
    """A prompt's n rows at once (causal), then n more rows after it (each sees the first
    chunk whole): kt_attention_decode_f32 on the rows' contexts vs torch's SDPA on 4-D inputs
    (its flash kernel; is_causal where there is no earlier context, a mask where there is)"""
    n, scale = args.prefill, args.dim ** -0.5
    k, v = torch.randn(2 * n, args.kv_heads, args.dim), torch.randn(2 * n, args.kv_heads, args.dim)
    q = torch.randn(n, args.heads, args.dim)
    for past in (0, n):
        length = past + n
        contexts = ops.Contexts.causal([torch.arange(length)], [n])
        mask = None if past == 0 else torch.arange(length)[None, :] <= torch.arange(past, length)[:, None]

        def sdpa():
            a, b, c = (t.transpose(0, 1)[None] for t in (q, k[:length], v[:length]))
            return F.scaled_dot_product_attention(a, b, c, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                  enable_gqa=args.heads != args.kv_heads)
        kt = microseconds(lambda: ops.paged_attention(q, k, v, contexts, scale), 3)
        row(f"prefill attention, {n} after {past}", kt, microseconds(sdpa, 3))


def mla_prefill_rows(args) -> None:
    """MLA prefill, expanded (DeepSeek-V3's per-head dims: keys 128 + 64 rope, values 128, one KV
    head per query head): kt's kernel vs torch's SDPA, causal over n rows"""
    n, heads, scale = args.prefill, args.mla_heads, 192 ** -0.5
    q, k, v = torch.randn(n, heads, 192), torch.randn(n, heads, 192), torch.randn(n, heads, 128)
    contexts = ops.Contexts.causal([torch.arange(n)], [n])

    def sdpa():
        a, b, c = (t.transpose(0, 1)[None] for t in (q, k, v))
        return F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale)
    kt = microseconds(lambda: ops.paged_attention(q, k, v, contexts, scale), 3)
    row(f"MLA prefill, {heads} heads, {n} tokens", kt, microseconds(sdpa, 3))


def rope_rows(args) -> None:
    rotary = Rotary(RopeSpec(args.dim, 1e6), torch.device("cpu"))
    for n in (1, args.prefill):
        tables = rotary.tables(torch.arange(n), torch.float32)
        x = torch.randn(n, args.heads + args.kv_heads, args.dim)
        repeats = max(3, 3000 // n)
        row(f"rope, {n} tokens", microseconds(lambda: rotary.apply_(x, tables), repeats),
            microseconds(lambda: rotary.apply(x, tables), repeats))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(f"kt variant {ops.default().kernels.variant}, {ops.default().threads} kt threads; "
          f"{args.heads}/{args.kv_heads} heads of {args.dim}")
    print(f"{'':34s} {'kt us':>10s} {'torch us':>10s} {'speedup':>9s}")
    decode_rows(args)
    rope_rows(args)
    torch.set_num_threads(args.threads)
    prefill_rows(args)
    mla_prefill_rows(args)


if __name__ == "__main__":
    main()
