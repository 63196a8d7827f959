"""llama.cpp as a peer for bench/e2e.py, run under an interpreter that has llama-cpp-python
(it imports nothing from kt): times prefill of N-token prompts (ppN) and decode of N
tokens after a one-token prompt (tgN), or after a D-token one (--depth D: tgN@dD, its prefill
not timed) on a GGUF, like llama-bench, and prints JSON rows {"test", "tokens_per_s",
"stddev"}. Token ids are random, as in e2e.py.

    OTHER_PYTHON bench/llamacpp_peer.py MODEL --pp 512 --tg 64 [--depth 0] --repeats 3 --threads 2
"""

import argparse
import json
import random
import statistics
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--pp", type=int, nargs="*", default=[])
    parser.add_argument("--tg", type=int, nargs="*", default=[])
    parser.add_argument("--depth", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def tokens(llm, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    vocab = llm.n_vocab()
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def prefill_seconds(llm, n: int, seed: int) -> float:
    llm.reset()
    prompt = tokens(llm, n, seed)
    start = time.perf_counter()
    llm.eval(prompt)
    return time.perf_counter() - start


def decode_seconds(llm, n: int, seed: int, depth: int = 0) -> float:
    llm.reset()
    ids = tokens(llm, n + max(depth, 1), seed)
    llm.eval(ids[:max(depth, 1)])
    start = time.perf_counter()
    for tok in ids[max(depth, 1):]:
        llm.eval([tok])
    return time.perf_counter() - start


def measure(llm, kind: str, n: int, repeats: int, depth: int = 0) -> dict:
    def run(count: int, seed: int) -> float:
        return prefill_seconds(llm, count, seed) if kind == "pp" else decode_seconds(llm, count, seed, depth)
    run(min(n, 16), seed=0)
    rates = [n / run(n, seed=1 + i) for i in range(repeats)]
    name = f"{kind}{n}@d{depth}" if kind == "tg" and depth else f"{kind}{n}"
    return {"test": name, "tokens_per_s": statistics.mean(rates),
            "stddev": statistics.stdev(rates) if len(rates) > 1 else 0.0}


def main() -> None:
    from llama_cpp import Llama

    args = parse_args()
    longest = max([*args.pp, *(n + args.depth for n in args.tg), 16]) + 2
    llm = Llama(args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=longest,
                n_batch=max(args.pp + [16, min(args.depth, 512)]), n_ubatch=max(args.pp + [16, min(args.depth, 512)]), verbose=False)
    rows = [measure(llm, "pp", n, args.repeats) for n in args.pp]
    rows += [measure(llm, "tg", n, args.repeats, args.depth) for n in args.tg]
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
