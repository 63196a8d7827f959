"""End-to-end tokens/s through kt's engine, like llama-bench: prefill of N-token prompts
(ppN) and batch-1 greedy decode of N tokens (tgN; with --depth D, tgN@dD: decode after a
D-token prompt, as llama-bench's -d). Prints a table, or JSON with --json.

Peers, in the same run:
- llama.cpp's stored figures (shared/reference/llamacpp_bench.json, an AVX-512 host with
  ~47.5 GB/s of read bandwidth) for SmolLM2 and the scaled Qwen3-MoE of bench/scaled_model.py.
  Decode reads every active weight once a token, so its figure is also shown scaled by the
  read bandwidth this run measures (the kt doctor probe, before and after) over the stored
  host's; prefill is bound by compute, and its stored figure is shown as it is.
- --llama-cpp PYTHON: llama.cpp itself, through bench/llamacpp_peer.py run by an interpreter
  that has llama-cpp-python, on the same file and threads. With --rounds R, kt's tests and
  llama.cpp's alternate R times, so a slow spell of a shared machine falls on both: each
  figure is the median over rounds, and the ratio the median of the rounds' own ratios, printed
  with the lowest and highest of them (--json: peer_ratios).

    python bench/e2e.py [MODEL] [--pp 128 512] [--tg 64] [--depth 0] [--repeats 3] [--rounds 1]
                        [--threads 2] [--llama-cpp OTHER_PYTHON] [--json]
"""

import argparse
import json
import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

import kt_cli  # noqa: F401  before torch: it sets GOMP_SPINCOUNT, which libgomp reads as torch loads
import torch

from kt_cli import LLM, SamplingParams, hardware, ops, store
from kt_cli.doctor import MEMBW_PROBE_BYTES

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "llamacpp_bench.json"
REFERENCE_GBPS = 47.5    # the stored host's 2-thread read bandwidth (issue #4: ~45-50 GB/s)
PEER = Path(__file__).resolve().parent / "llamacpp_peer.py"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(store.default_model_path()))
    parser.add_argument("--pp", type=int, nargs="*", default=[128, 512])
    parser.add_argument("--tg", type=int, nargs="*", default=[64])
    parser.add_argument("--depth", type=int, default=0,
                        help="decode after a prompt of this many tokens (llama-bench's -d; its prefill not timed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="alternations of kt's runs and llama.cpp's")
    parser.add_argument("--threads", type=int, default=None, help="kt kernel threads")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--llama-cpp", metavar="PYTHON", help="an interpreter with llama-cpp-python: run it too")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab - 1000, (n,), generator=g).tolist()


def prefill_seconds(llm: LLM, n: int, seed: int) -> float:
    engine = llm.engine
    engine.add_request(random_prompt(n, llm.engine.vocab_size, seed), SamplingParams(temperature=0.0, max_tokens=1))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def decode_seconds(llm: LLM, n: int, seed: int, depth: int = 0) -> float:
    """Time of n decode steps after a prompt of max(depth, 1) tokens (its prefill, one step, not
    counted)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True)
    engine.add_request(random_prompt(max(depth, 1), llm.engine.vocab_size, seed), params)
    engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def measure(llm: LLM, kind: str, n: int, repeats: int, depth: int = 0) -> dict:
    run = prefill_seconds if kind == "pp" else partial(decode_seconds, depth=depth)
    run(llm, min(n, 16), seed=0)
    rates = [n / run(llm, n, seed=1 + i) for i in range(repeats)]
    return {"test": test_name(kind, n, depth), "tokens_per_s": statistics.mean(rates),
            "stddev": statistics.stdev(rates) if len(rates) > 1 else 0.0}


def test_name(kind: str, n: int, depth: int) -> str:
    """llama-bench's names: pp512, tg64, and tg64@d4096 for decode after 4096 tokens"""
    return f"{kind}{n}@d{depth}" if kind == "tg" and depth else f"{kind}{n}"


def reference_name(model: str) -> str:
    """The stored llama-bench file name a model file stands for: its own, or for the scaled
    Qwen3-MoE of bench/scaled_model.py (qwen3moe-8L-Q4_0.gguf) the stored one of its type
    (qwen3moe-8L-A0.6B-Q4_0.gguf)."""
    name = Path(model).name
    if name.startswith("qwen3moe-8L-") and not name.startswith("qwen3moe-8L-A"):
        return "qwen3moe-8L-A0.6B-" + name.removeprefix("qwen3moe-8L-")
    return name


def llamacpp_figures(model: str) -> dict[str, dict]:
    """llama-bench rows for this model file, keyed ppN, and tg for its one decode row."""
    if not REFERENCE.is_file():
        return {}
    rows = json.loads(REFERENCE.read_text())["rows"]
    return {(f"pp{r['n_prompt']}" if r["n_prompt"] else "tg"):
            {"tokens_per_s": r["avg_ts"], "n": r["n_gen"] or r["n_prompt"]}
            for r in rows if r["model"] == reference_name(model)}


def read_gbps() -> float:
    """The read bandwidth kt doctor reports, measured the same way"""
    return float(ops.membw_read_gbps(MEMBW_PROBE_BYTES, 3))


def run_peer(python: str, args: argparse.Namespace) -> dict[str, dict]:
    command = [python, str(PEER), args.model, "--pp", *map(str, args.pp), "--tg", *map(str, args.tg),
               "--depth", str(args.depth), "--repeats", str(args.repeats), "--threads", str(args.threads or hardware.default_threads())]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:
        raise SystemExit(f"llama.cpp peer: cannot run {python}: {exc.strerror}") from None
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp peer failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    try:
        return {row["test"]: row for row in json.loads(done.stdout)}
    except (ValueError, KeyError, TypeError):
        raise SystemExit("llama.cpp peer printed no result rows") from None


def main() -> None:
    args = parse_args()
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit("--rounds and --repeats must be at least 1")
    if args.depth < 0:
        raise SystemExit("--depth must be at least 0")
    longest = max([*args.pp, *(n + args.depth for n in args.tg), 16]) + 2
    llm = LLM(args.model, threads=args.threads, torch_threads=args.torch_threads, ctx=longest,
              max_batch=1, max_step_tokens=longest, prefix_caching=False)
    probes = [read_gbps()]
    kt_rounds, peer_rounds = [], []
    for _ in range(args.rounds):
        kt_rounds.append([measure(llm, "pp", n, args.repeats) for n in args.pp]
                         + [measure(llm, "tg", n, args.repeats, args.depth) for n in args.tg])
        if args.llama_cpp:
            peer_rounds.append(run_peer(args.llama_cpp, args))
    probes.append(read_gbps())
    results = combine(kt_rounds, peer_rounds)
    add_references(results, args.model, statistics.mean(probes))
    if args.json:
        print(json.dumps({"model": args.model, "kt_threads": hardware.default_threads(),
                          "torch_threads": torch.get_num_threads(), "read_gbps": probes, "rounds": args.rounds,
                          "results": results}, indent=1))
        return
    print(f"read bandwidth (kt doctor probe) before / after: {probes[0]:.1f} / {probes[1]:.1f} GB/s; "
          f"stored llama.cpp host: {REFERENCE_GBPS} GB/s; {args.rounds} round(s)")
    print(f"{'test':>8} {'kt tok/s':>10} {'+/-':>7}   {'llama.cpp here':>26}   {'stored (n)':>16}"
          f"   {'stored x bw':>12}")
    for row in results:
        print(f"{row['test']:>8} {row['tokens_per_s']:>10.2f} {row['stddev']:>7.2f}   {_peer_text(row):>26}"
              f"   {_reference_text(row['llamacpp']):>16}   {_scaled_text(row):>12}")


def combine(kt_rounds: list[list[dict]], peer_rounds: list[dict[str, dict]]) -> list[dict]:
    """One row per test: medians over rounds (the stddev of a single round is within it, of
    several across their means), and with a peer each round's kt / peer ratio and their median."""
    results = []
    for i, first in enumerate(kt_rounds[0]):
        rates = [r[i]["tokens_per_s"] for r in kt_rounds]
        row = {"test": first["test"], "tokens_per_s": statistics.median(rates),
               "stddev": statistics.stdev(rates) if len(rates) > 1 else first["stddev"]}
        peers = [p[row["test"]] for p in peer_rounds if row["test"] in p]
        if len(peers) == len(kt_rounds):
            row["peer"] = {**peers[0], "tokens_per_s": statistics.median(p["tokens_per_s"] for p in peers)}
            row["peer_ratios"] = [k / p["tokens_per_s"] for k, p in zip(rates, peers)]
            row["peer_ratio"] = statistics.median(row["peer_ratios"])
        results.append(row)
    return results


def add_references(results: list[dict], model: str, gbps: float) -> None:
    reference = llamacpp_figures(model)
    for row in results:
        if "@" in row["test"]:          # the stored figures have no depth
            row["llamacpp"] = None
            continue
        row["llamacpp"] = reference.get(row["test"]) or reference.get(row["test"][:2])
        if row["llamacpp"] and row["test"].startswith("tg"):
            row["llamacpp_scaled"] = row["llamacpp"]["tokens_per_s"] * gbps / REFERENCE_GBPS


def _peer_text(row: dict) -> str:
    """the peer's rate and the median ratio, with the rounds' lowest and highest ratios where there
    are several (this host's noise moves a round's ratio by ~10%)"""
    peer = row.get("peer")
    if not peer:
        return "-"
    ratios = row["peer_ratios"]
    spread = f" {min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""
    return f"{peer['tokens_per_s']:.2f} ({row['peer_ratio']:.2f}x{spread})"


def _reference_text(ref: dict | None) -> str:
    return f"{ref['tokens_per_s']:.2f} (n={ref['n']})" if ref else "-"


def _scaled_text(row: dict) -> str:
    scaled = row.get("llamacpp_scaled")
    return f"{scaled:.1f} ({row['tokens_per_s'] / scaled:.2f}x)" if scaled else "-"


if __name__ == "__main__":
    main()
