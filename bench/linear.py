"""Linear-layer throughput per weight format, beside torch's float32 matmul and
the memory bandwidth probe, all measured in the same run.

  python bench/linear.py [--variant avx2] [--threads N] [--repeats 20] [--footprint-mib 512]
                         [--formats i8,i4] [--baseline OLD.so]

GB/s counts the weight bytes (data + scales + mins) read per call: in decode
(m = 1) a linear is memory-bound, so GB/s over the probe's GB/s is the fraction
of the machine's bandwidth the kernel reaches. Each timed call uses the next of
several copies of the weight (--footprint-mib in all), so weights come from
memory, as in a real model, not from the last-level cache.

--baseline OLD.so times a saved copy of the same variant's library (e.g. the .so
before a kernel change) beside the installed one, calls alternating, so both see
the same machine load; its rows are marked "@base". Calls are then spaced by
POOL_SETTLE_S so neither pool's spinning workers steal the other's cores (both
then pay a worker wake-up per call).
i4-g32a, i8-g32 and i8-g16 are the layouts of GGUF Q4_1, Q8_0 and Q6_K. Each I8/I4 row
is timed in the row layout, tiled ("-tiled", kt.h KT_LAYOUT_TILES, what I8 loads as) and, for I4,
in the 8-row layout ("-row8", KT_LAYOUT_ROW8, what I4 loads as where the kernels have it).
--acts int16|f32 times the dense layers' paths (int16 in decode, f32 from 16 tokens).
"""

import argparse
import dataclasses
import time

import kt_cli  # noqa: F401  before torch: it sets GOMP_SPINCOUNT, which libgomp reads as torch loads
import torch

from kt_cli import hardware, kernels
from kt_cli.kernels import baseline_kernels
from kt_cli.ops import Ops, kernel_layout
from kt_weights.layout import Format, QMatrix, can_row8, quantize_reference, to_row8

SHAPES = [(2048, 2048), (768, 2048)]
TOKENS = [1, 128]
FORMATS = [("f32", Format.F32, 0, True), ("bf16", Format.BF16, 0, True), ("f16", Format.F16, 0, True),
           ("i8", Format.I8, 128, True), ("i4", Format.I4, 128, True), ("i4-asym", Format.I4, 128, False),
           ("i4-g32a", Format.I4, 32, False), ("i8-g32", Format.I8, 32, True), ("i8-g16", Format.I8, 16, True)]
POOL_SETTLE_S = 0.005   # lets the other library's pool workers stop spinning and sleep
FLOAT_DTYPES = {Format.F32: torch.float32, Format.BF16: torch.bfloat16, Format.F16: torch.float16}


def make_weight(w: torch.Tensor, fmt: Format, group: int, symmetric: bool) -> QMatrix:
    if fmt.quantized:
        return quantize_reference(w, fmt, group, symmetric)
    return QMatrix(fmt, w.shape[0], w.shape[1], w.to(FLOAT_DTYPES[fmt]).contiguous())


def copies_of(w: QMatrix, footprint: int) -> list[QMatrix]:
    n = max(2, min(256, -(-footprint // w.nbytes())))
    clone = {name: getattr(w, name).clone() for name in ("data", "scale", "min") if getattr(w, name) is not None}
    return [w] + [dataclasses.replace(w, **{k: v.clone() for k, v in clone.items()}) for _ in range(n - 1)]


def time_ms(fns: list, args: list, repeats: int) -> list[float]:
    """Median of each fn over `repeats` calls, the fns alternating, each call on
    the next copy of the operands."""
    times = [[] for _ in fns]
    for fn in fns:
        fn(args[0])
    for i in range(repeats):
        for fn, ts in zip(fns, times):
            if len(fns) > 1:
                time.sleep(POOL_SETTLE_S)
            start = time.perf_counter()
            fn(args[(i + 1) % len(args)])
            ts.append(time.perf_counter() - start)
    return [sorted(ts)[len(ts) // 2] * 1e3 for ts in times]


def row(name: str, m: int, rows: int, cols: int, ms: float, nbytes: int, bw: float) -> str:
    gbps, gflops = nbytes / ms / 1e6, 2 * m * rows * cols / ms / 1e6
    return (f"{name:10s} {rows:5d}x{cols:<5d} m={m:<4d} {ms:8.3f} ms {gbps:7.2f} GB/s "
            f"{100 * gbps / bw:5.1f}% of probe {gflops:8.1f} GFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--footprint-mib", type=int, default=512)
    parser.add_argument("--formats", default=",".join(f[0] for f in FORMATS))
    parser.add_argument("--baseline", default=None, help="a saved .so of the same variant to time beside")
    parser.add_argument("--acts", choices=["int8", "int16", "f32"], default="int8",
                        help="activations of I8/I4 weights (dense layers: int16 in decode, f32 in prefill)")
    args = parser.parse_args()
    loaded = kernels.load_variant(args.variant) if args.variant else kernels.load()
    ops = Ops(loaded, args.threads or hardware.default_threads())
    variants = [("", ops)]
    if args.baseline:
        variants.append(("@base", Ops(baseline_kernels(args.baseline, loaded.variant), ops.threads)))
    torch.set_num_threads(ops.threads)
    bw = ops.membw_read_gbps()
    print(f"variant {loaded.variant}, {ops.threads} threads, membw probe {bw:.2f} GB/s")
    formats = [f for f in FORMATS if f[0] in args.formats.split(",")]
    for rows, cols in SHAPES:
        for m in TOKENS:
            bench_shape(rows, cols, m, formats, variants, args, bw)


def layouts_of(w: QMatrix) -> list:
    """(row-name suffix, w -> w in that layout): rows, tiled, and row8 where the shape allows"""
    if not w.format.quantized:
        return [("", lambda m: m)]
    layouts = [("", lambda m: m), ("-tiled", kernel_layout)]
    return layouts + [("-row8", to_row8)] if can_row8(w) else layouts


def bench_shape(rows: int, cols: int, m: int, formats: list, variants: list, args, bw: float) -> None:
    footprint = args.footprint_mib << 20
    w32 = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols))
    x = torch.randn(m, cols)
    n_copies = len(copies_of(make_weight(w32, Format.F32, 0, True), footprint))
    torch_copies = [w32] + [w32.clone() for _ in range(n_copies - 1)]
    [ms] = time_ms([lambda w: x @ w.T], torch_copies, args.repeats)
    print(row("torch-f32", m, rows, cols, ms, w32.numel() * 4, bw))
    for name, fmt, group, symmetric in formats:
        w = make_weight(w32, fmt, group, symmetric)
        for suffix, layout in layouts_of(w):
            weights = copies_of(layout(w), footprint)
            fns = [lambda w, o=o: o.linear(x, w, acts=args.acts) for _, o in variants]
            for (tag, _), ms in zip(variants, time_ms(fns, weights, args.repeats)):
                print(row(name + suffix + tag, m, rows, cols, ms, weights[0].nbytes(), bw))
            del weights


if __name__ == "__main__":
    main()
