"""kt-kernel (KTransformers' CPU MoE kernels, PyPI kt-kernel) on one MoE layer, as a peer
of bench/moe_layer.py: prints JSON rows {method, T, ms, rel_err} for random bf16 weights
quantized online by kt-kernel itself (AMXINT8, AMXINT4: on CPUs without AMX its wheel runs
them on AVX-512), uniform random top-k routing drawn afresh for each timed call.

kt-kernel 0.7.2 pins torch 2.9.1 and its CUDA build, but its CPU extension links no torch:
unpack the wheel and put it on PYTHONPATH beside this machine's torch,

    pip download --no-deps kt-kernel==0.7.2 -d /tmp/ktk && unzip -q /tmp/ktk/*.whl -d /tmp/ktk/pkg
    python bench/moe_layer.py --kt-kernel /tmp/ktk/pkg

which runs this script with PYTHONPATH=/tmp/ktk/pkg and KT_FORCE_SYNC_SUBMIT=1 (its CPU-only
submit path). Its wrapper allocates pinned buffers, which a torch without CUDA refuses; here
they are plain ones. rel_err: the T=1 output against a float64 layer on the same
(dequantized-from-bf16) weights, so a wrong setup shows instead of a fast wrong number.
"""

import argparse
import json
import statistics
import time

import torch

RESULT_MARK = "KT_KERNEL_PEER "


def _unpinned(factory):
    def make(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)
    return make


for _name in ("zeros", "empty", "ones", "full"):
    setattr(torch, _name, _unpinned(getattr(torch, _name)))

import kt_kernel  # noqa: E402  after the patch: its wrapper allocates at construction
from kt_kernel import KTMoEWrapper  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--inter", type=int, required=True)
    p.add_argument("--experts", type=int, required=True)
    p.add_argument("--top-k", type=int, required=True)
    p.add_argument("--tokens", type=int, nargs="+", required=True)
    p.add_argument("--methods", nargs="+", default=["AMXINT8", "AMXINT4"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.3)
    p.add_argument("--weight-dir", required=True, help="where kt-kernel writes its quantized weights")
    return p.parse_args()


def routing(T: int, experts: int, k: int, gen: torch.Generator):
    ids = torch.rand(T, experts, generator=gen).topk(k, dim=1).indices
    return ids, torch.softmax(torch.randn(T, k, generator=gen), dim=1)


def reference(x, ids, weights, gate, up, down) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            h = torch.nn.functional.silu(gate[e].double() @ xt) * (up[e].double() @ xt)
            out[t] += w * (down[e].double() @ h)
    return out


def time_method(args, method: str, gate, up, down) -> list[dict]:
    layer = KTMoEWrapper(layer_idx=0, num_experts=args.experts, num_experts_per_tok=args.top_k,
                         hidden_size=args.hidden, moe_intermediate_size=args.inter, gpu_experts_mask=None,
                         cpuinfer_threads=args.threads, threadpool_count=1,
                         weight_path=f"{args.weight_dir}/{method}", chunked_prefill_size=-(-max(args.tokens) // 512) * 512,   # kt-kernel wants whole steps
                         method=method)
    layer.load_weights_from_tensors(gate, up, down, torch.arange(args.experts, dtype=torch.int64))
    gen = torch.Generator().manual_seed(7)
    rows = []
    for T in args.tokens:
        x = torch.randn(T, args.hidden, generator=gen).bfloat16()
        ids, weights = routing(T, args.experts, args.top_k, gen)
        y = layer.forward(x, ids, weights, None).float()
        rel_err = None
        if T == 1:
            want = reference(x, ids, weights, gate, up, down)
            rel_err = float((y.double() - want).norm() / want.norm())
        times = []
        while not times or (sum(times) < args.min_time and len(times) < 32):
            ids, weights = routing(T, args.experts, args.top_k, gen)
            start = time.perf_counter()
            layer.forward(x, ids, weights, None)
            times.append(time.perf_counter() - start)
        rows.append({"method": method, "T": T, "ms": 1e3 * statistics.median(times), "rel_err": rel_err})
    return rows


def main() -> None:
    args = parse_args()
    gen = torch.Generator().manual_seed(0)
    E, H, I = args.experts, args.hidden, args.inter
    gate = (torch.randn(E, I, H, generator=gen) * 0.02).bfloat16()
    up = (torch.randn(E, I, H, generator=gen) * 0.02).bfloat16()
    down = (torch.randn(E, H, I, generator=gen) * 0.02).bfloat16()
    rows = [row for method in args.methods for row in time_method(args, method, gate, up, down)]
    result = {"version": getattr(kt_kernel, "__version__", "?"), "variant": kt_kernel.__cpu_variant__, "rows": rows}
    print(RESULT_MARK + json.dumps(result), flush=True)      # kt-kernel prints to stdout too


if __name__ == "__main__":
    main()
