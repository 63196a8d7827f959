"""Benchmark one MoE layer's routed experts: kt's fused operator against a plain
torch implementation of the same layer, with the memory read bandwidth of this
machine (the probe `kt doctor` uses) as the ceiling for decode.

    python bench/moe_layer.py                       # default run, < ~3 minutes
    python bench/moe_layer.py --shapes deepseek-v3 --tokens 1 8 128 --formats i4_g128
    python bench/moe_layer.py --threads 4 --min-time 1.0
    python bench/moe_layer.py --layouts --formats i4_g32 i4_g128 --tokens 1 8   # row8, tiled, split
    python bench/moe_layer.py --baseline OLD.so --formats q4_0 --tokens 128 512  # a kernel change
    python bench/moe_layer.py --kt-kernel /tmp/ktk/pkg     # kt-kernel as a peer (bench/ktkernel_peer.py)

--layouts times each I4 and I8 format three times: in its default layout (row8 where the
kernels have the 8-row kernel, gate and up interleaved in one matrix), tiled (fmt name +
"/tiled"), with gate and up as two matrices ("/split") and, for q5_k and q6_k, as I8 instead
of I6 ("/i8": row8 where the build takes I8 there and the shape allows), alternating them ROUNDS times
and keeping each one's fastest round, so all see the same load. --baseline OLD.so
does the same with a saved copy of the loaded variant's library (the .so from before a
kernel change), its rows marked "@base".

Weights are random codes (the kernels' speed does not depend on the values); i4_* have
a min per group and float32 scales, as kt's own quantizer makes them; q4_0 is a GGUF
Q4_0 model's experts as kt loads them (no mins, scales exact float16 values, which the
row8 layout keeps in float16); q4_k a Q4_K one's (scales and mins a half per 8 groups times
6-bit integers, which the row8 layout keeps as uint8 with float16 bases); q5_k and q6_k
Q5_K and Q6_K ones' (I8 codes of 6 bits, 0..31 with mins in groups of 32, or -32..31 in groups
of 16 with signed subs), which kt computes on as I6 where the build has its kernel ("/tiled":
the I8 tiled layout kt used before);
routing is uniform random top-k, drawn afresh for each of DRAWS calls that the timing
cycles through: one fixed routing would keep decode's few experts (21 MB for
Qwen3-30B-A3B INT4 at T=1) in a 32 MB L3 and time the cache, not the memory. Columns:
  kt ms       one kt_moe_forward call (median of the timed calls)
  GB/s        bytes of the distinct experts touched / time (weights + scales)
  bw          the read bandwidth probe (the one `kt doctor` runs), taken just before and
              just after the row's calls, the mean of the two: a shared machine's
              bandwidth drifts by a third within minutes, so each row gets its own ceiling
  %bw         GB/s as a share of bw
  GOP/s       2 * 3 * hidden * inter * (valid token-expert pairs) / time
  torch ms    the same layer (same shape, T and routing) as per-expert torch
              matmuls in --torch-dtype, measured once per shape
  speedup     torch ms / kt ms
A shape/format whose weights do not fit in the available RAM is skipped with a note.
--kt-kernel DIR (an unpacked kt-kernel wheel, see bench/ktkernel_peer.py) then runs kt-kernel
on the same shape and token counts in the same run, after kt's rows: its AMXINT8 against
kt's i8 and its AMXINT4 (one scale a row) against each of kt's INT4 formats; "kt faster" is
kt-kernel ms / kt ms.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass, replace

import kt_cli  # noqa: F401  before torch: it sets GOMP_SPINCOUNT, which libgomp reads as torch loads
import torch

from kt_cli import hardware, kernels
from kt_cli.kernels import baseline_kernels
from kt_cli.ops import Ops
from kt_cli.ops.moe import MoEExperts
from kt_weights.layout import Format, QMatrix

RAM_SHARE = 0.7
ROUNDS = 3          # --layouts, --baseline: alternations of the layouts or builds
POOL_SETTLE_S = 0.05  # between them: the other pool's spinning workers go to sleep
DRAWS = 16          # routings a row's timed calls cycle through


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    experts: int
    top_k: int
    default_tokens: tuple[int, ...]
    default_formats: tuple[str, ...]


SHAPES = {
    "qwen3-30b-a3b": Shape(2048, 768, 128, 8, (1, 8, 128, 512),
                           ("bf16", "i8", "i4_g32", "i4_g128", "q4_0", "q8_0", "q4_k", "q5_k", "q6_k")),
    "deepseek-v3": Shape(7168, 2048, 256, 8, (1, 8), ("i4_g128",)),
}

@dataclass(frozen=True)
class Weights:
    format: Format
    group: int | None           # None: one group per row (per output channel); 0 for BF16
    mins: bool = False          # I4 with a min per group (asymmetric)
    halves: bool = False        # scales exactly float16 values, as GGUF stores them: row8 keeps them so
    two_level: bool = False     # scales and mins a half per 8 groups times 6-bit integers (GGUF's Q4_K)
    six_bit: bool = False       # I8 codes of 6 bits (GGUF's Q6_K: -32..31, signed subs; Q5_K: 0..31), which
                                # kt computes on as I6 (kt.h KT_I6) where the build's kernel takes it


FORMATS = {
    "bf16": Weights(Format.BF16, 0),
    "i8": Weights(Format.I8, None),
    "i4_g32": Weights(Format.I4, 32, mins=True),        # kt's own quantizer: float32 scales
    "i4_g128": Weights(Format.I4, 128, mins=True),
    "q4_0": Weights(Format.I4, 32, halves=True),        # a GGUF Q4_0 model's experts as kt loads them
    "q8_0": Weights(Format.I8, 32, halves=True),        # and a Q8_0 one's
    "q4_k": Weights(Format.I4, 32, mins=True, two_level=True),     # and a Q4_K one's (kt.h KT_SCALE_K)
    "q5_k": Weights(Format.I8, 32, mins=True, two_level=True, six_bit=True),
    "q6_k": Weights(Format.I8, 16, two_level=True, six_bit=True),
}
TORCH_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


# ---- synthetic weights ---------------------------------------------------------------

def _tile(base: torch.Tensor, n: int) -> torch.Tensor:
    """[n, *base.shape] filled with copies of base (fast; values do not matter here)."""
    out = torch.empty((n, *base.shape), dtype=base.dtype)
    out.copy_(base.expand_as(out))
    return out


def _stacked(kind: Weights, group: int, n: int, rows: int, cols: int) -> dict[str, torch.Tensor]:
    if kind.format == Format.BF16:
        return {"data": _tile((torch.randn(rows, cols) / cols ** 0.5).to(torch.bfloat16), n)}
    groups = cols // group
    if kind.two_level:
        side = {"scale": _two_level(rows, groups, 1e-3 / 63, signed=not kind.mins)}
        if kind.mins:
            side["min"] = _two_level(rows, groups, -8e-3 / 63)
    else:
        side = {"scale": torch.rand(rows, groups) * 1e-3 + 1e-4}
        if kind.mins:
            side["min"] = -8e-3 * torch.rand(rows, groups)
    side = {k: _tile(v.half().float() if kind.halves else v, n) for k, v in side.items()}
    if kind.format == Format.I8:
        low, high = ((0, 32) if kind.mins else (-32, 32)) if kind.six_bit else (-127, 128)
        return {"data": _tile(torch.randint(low, high, (rows, cols), dtype=torch.int8), n), **side}
    return {"data": _tile(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8), n), **side}


def _two_level(rows: int, groups: int, base: float, signed: bool = False) -> torch.Tensor:
    """[rows, groups]: a half per 8 groups times 6-bit integers, one of them 63 (as Q4_K's d * sc), or
    signed: times -128..127, one of them -128 (as Q6_K's)"""
    bases = (base * (0.5 + torch.rand(rows, groups // 8, 1))).half().float()
    subs = torch.randint(-128 if signed else 0, 128 if signed else 64, (rows, groups // 8, 8)).float()
    subs[..., 0] = -128 if signed else 63
    return (bases * subs).reshape(rows, groups)


def _matrices(kind: Weights, group: int, n: int, rows: int, cols: int) -> list[QMatrix]:
    s = _stacked(kind, group, n, rows, cols)
    side = [s.get(k) for k in ("scale", "min")]
    return [QMatrix(kind.format, rows, cols, s["data"][e], group, *(t[e] if t is not None else None for t in side))
            for e in range(n)]


def _group(name: str, cols: int) -> int:
    kind = FORMATS[name]
    return 0 if kind.format == Format.BF16 else (kind.group or cols)


def layer_weights(shape: Shape, name: str) -> tuple[list, list, list]:
    kind = FORMATS[name]
    H, I, E = shape.hidden, shape.inter, shape.experts
    return (_matrices(kind, _group(name, H), E, I, H), _matrices(kind, _group(name, H), E, I, H),
            _matrices(kind, _group(name, I), E, H, I))


def expert_bytes(shape: Shape, name: str) -> int:
    """What decode reads per expert: codes, scales and mins as they lie in the layout kt computes on
    (I4 row8: scales and mins in float16 when they are exact halves, uint8 with a half per 8 groups
    when they factor so)"""
    H, I = shape.hidden, shape.inter
    kind = FORMATS[name]
    if kind.format == Format.BF16:
        return 3 * H * I * 2
    per_weight = 0.75 if kind.six_bit else 1.0 if kind.format == Format.I8 else 0.5
    side = (1.25 if kind.two_level else 2 if kind.halves else 4) * (2 if kind.mins else 1)
    return int(3 * H * I * per_weight + side * (2 * I * (H // _group(name, H)) + H * (I // _group(name, I))))


# ---- routing and the torch reference layer ----------------------------------------------

def routing(shape: Shape, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, shape.experts, generator=gen).topk(shape.top_k, dim=1).indices
    weights = torch.softmax(torch.randn(T, shape.top_k, generator=gen), dim=1)
    return ids.to(torch.int32).contiguous(), weights.contiguous()


def torch_layer(weights: tuple[list, list, list], x, ids, topk_weights, dtype) -> torch.Tensor:
    gate, up, down = weights
    out = torch.zeros_like(x)
    xd = x.to(dtype)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xs = xd[tok]
        h = torch.nn.functional.silu(xs @ gate[e].T) * (xs @ up[e].T)
        out.index_add_(0, tok, (h @ down[e].T).float() * topk_weights[tok, slot, None])
    return out


def torch_weights(shape: Shape, dtype) -> tuple[torch.Tensor, ...]:
    H, I, E = shape.hidden, shape.inter, shape.experts
    return tuple(_tile((torch.randn(rows, cols) / cols ** 0.5).to(dtype), E)
                 for rows, cols in ((I, H), (I, H), (H, I)))


# ---- timing -----------------------------------------------------------------------------

def time_call(fn, min_time: float, max_reps: int, warm_up: bool = True) -> float:
    """Median seconds of one call fn(i) (after a warm-up call), over calls i = 0, 1, ...
    totalling >= min_time."""
    if warm_up:
        fn(DRAWS - 1)
    times = []
    while not times or (sum(times) < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn(len(times))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class Row:
    shape: str
    fmt: str
    T: int
    kt_s: float
    touched_bytes: int
    pairs: int
    torch_s: float | None
    bw: float = 0.0             # GB/s probed beside this row's calls


def inputs(shape: Shape, T: int, draw: int = 0):
    seed = T * DRAWS + draw
    return (torch.randn(T, shape.hidden, generator=torch.Generator().manual_seed(seed)), *routing(shape, T, seed))


def draws(shape: Shape, T: int) -> list[tuple[torch.Tensor, ...]]:
    return [inputs(shape, T, d) for d in range(DRAWS)]


def torch_baseline(shape_name: str, shape: Shape, tokens, args) -> dict[int, float]:
    dtype = TORCH_DTYPES[args.torch_dtype]
    gb = 3 * shape.experts * shape.hidden * shape.inter * dtype.itemsize / 1e9
    if args.no_torch or gb * 1e9 > RAM_SHARE * hardware.memory().available_bytes:
        if not args.no_torch:
            print(f"{shape_name:<14} torch baseline skipped: {args.torch_dtype} weights need {gb:.1f} GB", flush=True)
        return {}
    tw = torch_weights(shape, dtype)
    torch.set_num_threads(args.torch_threads or args.threads)
    baseline = {}
    for T in tokens:
        calls = draws(shape, T)
        baseline[T] = time_call(lambda i: torch_layer(tw, *calls[i % DRAWS], dtype), args.min_time,
                                args.max_reps, warm_up=T <= 8)
    return baseline


def measure(shape_name: str, shape: Shape, name: str, moe: MoEExperts, T: int, args,
            baseline: dict[int, float], ops: Ops) -> Row:
    calls = draws(shape, T)
    bw_before = ops.membw_read_gbps()
    kt_s = time_call(lambda i: moe.forward(*calls[i % DRAWS]), args.min_time, args.max_reps)
    bw = (bw_before + ops.membw_read_gbps()) / 2
    touched = statistics.mean(len(ids.unique()) for _, ids, _ in calls) * expert_bytes(shape, name)
    return Row(shape_name, name, T, kt_s, touched, int((calls[0][1] >= 0).sum()), baseline.get(T), bw)


# ---- report -------------------------------------------------------------------------------

HEADER = (f"{'shape':<14} {'fmt':<13} {'T':>5} {'kt ms':>9} {'GB/s':>7} {'bw':>5} {'%bw':>5} {'GOP/s':>7} "
          f"{'torch ms':>9} {'speedup':>8}")


def format_row(r: Row, shape: Shape) -> str:
    gbs = r.touched_bytes / r.kt_s / 1e9
    gops = 2 * 3 * shape.hidden * shape.inter * r.pairs / r.kt_s / 1e9
    torch_ms = f"{r.torch_s * 1e3:9.2f}" if r.torch_s else f"{'n/a':>9}"
    speedup = f"{r.torch_s / r.kt_s:7.2f}x" if r.torch_s else f"{'':>8}"
    return (f"{r.shape:<14} {r.fmt:<13} {r.T:>5} {r.kt_s * 1e3:9.2f} {gbs:7.2f} {r.bw:5.1f} {100 * gbs / r.bw:4.0f}% "
            f"{gops:7.1f} {torch_ms} {speedup}")


def run_shape(shape_name: str, args, ops: Ops, base_ops: Ops | None) -> None:
    shape = SHAPES[shape_name]
    tokens = args.tokens or shape.default_tokens
    baseline = torch_baseline(shape_name, shape, tokens, args)
    rows = []
    for name in args.formats or shape.default_formats:
        gb = shape.experts * expert_bytes(shape, name) / 1e9
        if gb * 1e9 > RAM_SHARE * hardware.memory().available_bytes:
            print(f"{shape_name:<14} {name:<13} skipped: needs {gb:.1f} GB, more than "
                  f"{RAM_SHARE:.0%} of the available RAM", flush=True)
            continue
        weights = layer_weights(shape, name)
        layouts = {name: MoEExperts(*weights, ops=ops)}
        if args.layouts and FORMATS[name].format in (Format.I4, Format.I8):
            layouts[f"{name}/tiled"] = MoEExperts(*weights, ops=ops, row8=False)
            layouts[f"{name}/split"] = MoEExperts(*weights, ops=ops, interleave=False)
            if FORMATS[name].six_bit:
                layouts[f"{name}/i8"] = MoEExperts(*weights, ops=ops, i6=False)
        if base_ops is not None:
            layouts[f"{name}@base"] = MoEExperts(*weights, ops=base_ops)
        for T in tokens:
            for row in measure_layouts(shape_name, shape, layouts, T, args, baseline, ops):
                print(format_row(row, shape), flush=True)
                rows.append(row)
        del layouts, weights
    if args.kt_kernel:
        compare_with_kt_kernel(shape_name, shape, tokens, rows, args)


# ---- kt-kernel as a peer (bench/ktkernel_peer.py) -------------------------------------

PEER = Path(__file__).resolve().parent / "ktkernel_peer.py"
PEER_METHODS = {"AMXINT8": lambda fmt: fmt == "i8", "AMXINT4": lambda fmt: fmt.startswith("i4") or fmt in ("q4_0", "q4_k")}


def run_kt_kernel(shape: Shape, tokens, args) -> dict:
    env = {**os.environ, "PYTHONPATH": args.kt_kernel, "KT_FORCE_SYNC_SUBMIT": "1"}
    with tempfile.TemporaryDirectory(prefix="ktk-weights-") as weights:
        command = [sys.executable, str(PEER), "--hidden", str(shape.hidden), "--inter", str(shape.inter),
                   "--experts", str(shape.experts), "--top-k", str(shape.top_k), "--tokens", *map(str, tokens),
                   "--threads", str(args.threads), "--min-time", str(args.min_time), "--weight-dir", weights]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    marked = [line for line in done.stdout.splitlines() if line.startswith("KT_KERNEL_PEER ")]
    if done.returncode != 0 or not marked:
        raise SystemExit(f"kt-kernel peer failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(marked[-1].removeprefix("KT_KERNEL_PEER "))


def compare_with_kt_kernel(shape_name: str, shape: Shape, tokens, rows: list[Row], args) -> None:
    peer = run_kt_kernel(shape, tokens, args)
    print(f"{shape_name:<14} kt-kernel {peer['version']} ({peer['variant']} build), same run, after kt's rows:")
    print(f"{'':<14} {'method':<9} {'T':>5} {'ms':>9} {'rel err':>8}   {'kt fmt':<13} {'kt ms':>9} {'kt faster':>10}")
    for p in peer["rows"]:
        err = f"{p['rel_err']:8.3f}" if p["rel_err"] is not None else f"{'':>8}"
        mine = [r for r in rows if r.T == p["T"] and PEER_METHODS[p["method"]](r.fmt)] or [None]
        for r in mine:
            kt = f"{r.fmt:<13} {r.kt_s * 1e3:9.2f} {p['ms'] / (r.kt_s * 1e3):9.2f}x" if r else ""
            print(f"{'':<14} {p['method']:<9} {p['T']:>5} {p['ms']:9.2f} {err}   {kt}", flush=True)


def measure_layouts(shape_name: str, shape: Shape, layouts: dict[str, MoEExperts], T: int, args,
                    baseline: dict[int, float], ops: Ops) -> list[Row]:
    """One row per layout; with several, the fastest of ROUNDS alternations each."""
    rounds = ROUNDS if len(layouts) > 1 else 1
    best: dict[str, Row] = {}
    for _ in range(rounds):
        for label, moe in layouts.items():
            if rounds > 1:
                time.sleep(POOL_SETTLE_S)
            fmt = label.split("/")[0].split("@")[0]
            row = replace(measure(shape_name, shape, fmt, moe, T, args, baseline, ops), fmt=label)
            if label not in best or row.kt_s < best[label].kt_s:
                best[label] = row
    return list(best.values())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), help="default: per shape")
    p.add_argument("--tokens", nargs="+", type=int, help="default: per shape")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per row")
    p.add_argument("--max-reps", type=int, default=2 * DRAWS)
    p.add_argument("--torch-dtype", choices=list(TORCH_DTYPES), default="f32",
                   help="f32 (default): torch bf16 matmuls are far slower on CPUs without AVX512-BF16")
    p.add_argument("--torch-threads", type=int, help="default: --threads (on a loaded machine torch's "
                   "OpenMP threads slow down far more than kt's pool; try 1)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--layouts", action="store_true", help="I4 and I8 also tiled, alternating with the default layout")
    p.add_argument("--baseline", metavar="OLD.so", help="a saved build of the loaded variant, alternating with it")
    p.add_argument("--kt-kernel", metavar="DIR", help="an unpacked kt-kernel wheel: run it as a peer (ktkernel_peer.py)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    ops = Ops(kernels.load(), threads=args.threads)
    base_ops = Ops(baseline_kernels(args.baseline, ops.kernels.variant), threads=args.threads) if args.baseline else None
    print(f"kt variant {ops.kernels.variant}, {args.threads} threads; memory read bandwidth probed per row; "
          f"torch {torch.__version__} in {args.torch_dtype} on {args.torch_threads or args.threads} threads; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(HEADER)
    for shape_name in args.shapes:
        run_shape(shape_name, args, ops, base_ops)


if __name__ == "__main__":
    main()
