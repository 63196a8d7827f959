"""Decode through the native decoder layer (kt_decode_layer_f32) against the layer modules,
alternating in one process so both see the same machine load: ms per token of batch-1 and
batch-4 greedy decode, and the ratio.

    python bench/decode_plan.py [MODEL] [--tokens 32] [--rounds 4] [--batch 1 4]
"""

import argparse
import statistics
import time

from kt_cli import LLM, SamplingParams, store

from e2e import random_prompt


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(store.default_model_path()))
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 4])
    return parser.parse_args()


def decode_ms(llm: LLM, batch: int, tokens: int, seed: int) -> float:
    """ms per decode step of `batch` sequences (after their 16-token prefill)"""
    engine = llm.engine
    for s in range(batch):
        engine.add_request(random_prompt(16, engine.vocab_size, seed * 100 + s),
                           SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True))
    engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) / tokens * 1e3


def main() -> None:
    args = parse_args()
    llm = LLM(args.model, max_batch=max(args.batch), prefix_caching=False)
    model = llm.engine.runner.model
    planned = sum(layer.decode_plan is not None for layer in model.layers)
    print(f"{args.model}: {planned} of {len(model.layers)} layers have a native decode plan")
    decode_ms(llm, 1, 4, 0)
    for batch in args.batch:
        times = {True: [], False: []}
        for r in range(args.rounds):
            for on in (False, True):
                model.use_decode_plans(on)
                times[on].append(decode_ms(llm, batch, args.tokens, r + 1))
        model.use_decode_plans(True)
        native, modules = statistics.median(times[True]), statistics.median(times[False])
        print(f"batch {batch}: modules {modules:.2f} ms/step ({', '.join(f'{t:.1f}' for t in times[False])}), "
              f"native layer {native:.2f} ms/step ({', '.join(f'{t:.1f}' for t in times[True])}): "
              f"{modules / native:.2f}x, {1e3 * batch / native:.1f} tok/s")


if __name__ == "__main__":
    main()
