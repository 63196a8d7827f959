"""End-to-end tokens/s through kt's engine, like llama-bench: prefill of N-token prompts
(ppN) and batch-1 greedy decode of N tokens (tgN). Prints a table, or JSON with --json;
for SmolLM2 it also shows llama.cpp's figures from shared/reference/llamacpp_bench.json.

    python bench/e2e.py [MODEL] [--pp 128 512] [--tg 64] [--repeats 3] [--threads 2] [--json]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kt_cli import LLM, SamplingParams, hardware, store

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "llamacpp_bench.json"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(store.default_model_path()))
    parser.add_argument("--pp", type=int, nargs="*", default=[128, 512])
    parser.add_argument("--tg", type=int, nargs="*", default=[64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="kt kernel threads")
    parser.add_argument("--torch-threads", type=int, default=None)
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


def decode_seconds(llm: LLM, n: int, seed: int) -> float:
    """Time of n decode steps after a one-token prompt (its prefill not counted)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True)
    engine.add_request(random_prompt(1, llm.engine.vocab_size, seed), params)
    engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def measure(llm: LLM, kind: str, n: int, repeats: int) -> dict:
    run = prefill_seconds if kind == "pp" else decode_seconds
    run(llm, min(n, 16), seed=0)
    rates = [n / run(llm, n, seed=1 + i) for i in range(repeats)]
    return {"test": f"{kind}{n}", "tokens_per_s": statistics.mean(rates),
            "stddev": statistics.stdev(rates) if len(rates) > 1 else 0.0}


def llamacpp_figures(model: str) -> dict[str, dict]:
    """llama-bench rows for this model file, keyed ppN, and tg for its one decode row."""
    if not REFERENCE.is_file():
        return {}
    rows = json.loads(REFERENCE.read_text())["rows"]
    return {(f"pp{r['n_prompt']}" if r["n_prompt"] else "tg"): {"tokens_per_s": r["avg_ts"], "n": r["n_gen"] or r["n_prompt"]}
            for r in rows if r["model"] == Path(model).name}


def main() -> None:
    args = parse_args()
    longest = max([*args.pp, *args.tg, 16]) + 2
    llm = LLM(args.model, threads=args.threads, torch_threads=args.torch_threads, ctx=longest,
              max_batch=1, max_step_tokens=longest, prefix_caching=False)
    results = [measure(llm, "pp", n, args.repeats) for n in args.pp]
    results += [measure(llm, "tg", n, args.repeats) for n in args.tg]
    reference = llamacpp_figures(args.model)
    for row in results:
        row["llamacpp"] = reference.get(row["test"]) or reference.get(row["test"][:2])
    if args.json:
        print(json.dumps({"model": args.model, "kt_threads": hardware.default_threads(),
                          "torch_threads": torch.get_num_threads(), "results": results}, indent=1))
        return
    print(f"{'test':>8} {'kt tok/s':>10} {'+/-':>7}   llama.cpp (same test or nearest n, 2 threads)")
    for row in results:
        print(f"{row['test']:>8} {row['tokens_per_s']:>10.2f} {row['stddev']:>7.2f}   {_reference_text(row['llamacpp'])}")


def _reference_text(ref: dict | None) -> str:
    return f"{ref['tokens_per_s']:.2f} (n={ref['n']})" if ref else "-"


if __name__ == "__main__":
    main()
