"""Linear-layer throughput per weight format, beside torch's float32 matmul and
the memory bandwidth probe, all measured in the same run.

  python bench/linear.py [--variant avx2] [--threads N] [--repeats 20] [--footprint-mib 512]

GB/s counts the weight bytes (data + scales + mins) read per call: in decode
(m = 1) a linear is memory-bound, so GB/s over the probe's GB/s is the fraction
of the machine's bandwidth the kernel reaches. Each timed call uses the next of
several copies of the weight (--footprint-mib in all), so weights come from
memory, as in a real model, not from the last-level cache.
"""

import argparse
import dataclasses
import time

import torch

from kt_cli import hardware, kernels
from kt_cli.ops import Ops
from kt_weights.layout import Format, QMatrix, quantize_reference

SHAPES = [(2048, 2048), (768, 2048)]
TOKENS = [1, 128]
FORMATS = [("f32", Format.F32, 0, True), ("bf16", Format.BF16, 0, True), ("f16", Format.F16, 0, True),
           ("i8", Format.I8, 128, True), ("i4", Format.I4, 128, True), ("i4-asym", Format.I4, 128, False)]
FLOAT_DTYPES = {Format.F32: torch.float32, Format.BF16: torch.bfloat16, Format.F16: torch.float16}


def make_weight(w: torch.Tensor, fmt: Format, group: int, symmetric: bool) -> QMatrix:
    if fmt.quantized:
        return quantize_reference(w, fmt, group, symmetric)
    return QMatrix(fmt, w.shape[0], w.shape[1], w.to(FLOAT_DTYPES[fmt]).contiguous())


def copies_of(w: QMatrix, footprint: int) -> list[QMatrix]:
    n = max(2, min(256, -(-footprint // w.nbytes())))
    clone = {name: getattr(w, name).clone() for name in ("data", "scale", "min") if getattr(w, name) is not None}
    return [w] + [dataclasses.replace(w, **{k: v.clone() for k, v in clone.items()}) for _ in range(n - 1)]


def time_ms(fn, args: list, repeats: int) -> float:
    """Median over `repeats` calls, each on the next copy of the operands."""
    fn(args[0])
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(args[(i + 1) % len(args)])
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


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
    args = parser.parse_args()
    loaded = kernels.load_variant(args.variant) if args.variant else kernels.load()
    ops = Ops(loaded, args.threads or hardware.default_threads())
    torch.set_num_threads(ops.threads)
    bw = ops.membw_read_gbps()
    print(f"variant {loaded.variant}, {ops.threads} threads, membw probe {bw:.2f} GB/s")
    footprint = args.footprint_mib << 20
    for rows, cols in SHAPES:
        w32 = torch.randn(rows, cols)
        torch_copies = [w32] + [w32.clone() for _ in range(len(copies_of(make_weight(w32, Format.F32, 0, True), footprint)) - 1)]
        for m in TOKENS:
            x = torch.randn(m, cols)
            ms = time_ms(lambda w: x @ w.T, torch_copies, args.repeats)
            print(row("torch-f32", m, rows, cols, ms, w32.numel() * 4, bw))
            for name, fmt, group, symmetric in FORMATS:
                weights = copies_of(make_weight(w32, fmt, group, symmetric), footprint)
                ms = time_ms(lambda w: ops.linear(x, w), weights, args.repeats)
                print(row(name, m, rows, cols, ms, weights[0].nbytes(), bw))
                del weights


if __name__ == "__main__":
    main()
