"""Expert placement on a random-weight scaled Qwen3-MoE (default 4 layers, hidden 1024,
64 experts, top-8, expert intermediate 384; bf16 checkpoint, byte-level tokens):

1. batch-1 greedy decode tokens/s vs the share of routed experts on the device
   (0, 25, 50, 100 %; on a machine without a GPU torch on the CPU stands in for it),
   with the MoE time split (CPU experts / device / transfers / overlap);
2. the device hit rate of each placement strategy at one budget, with the expert
   statistics recorded on one text and the hit rate measured on another (the two
   halves of shared/reference/kjv_genesis_1-10.txt), beside the hit rate of prefill
   re-placement and of an oracle placed on the measured text's own counts.

    python bench/placement.py [--layers 4 --hidden 1024 --experts 64 --top-k 8 --inter 384]
                              [--decode-tokens 16] [--text-tokens 1024] [--budget 0.25] [--device cpu]
"""

import argparse
import statistics
import time
from pathlib import Path

import kt_cli  # noqa: F401  before torch: it sets GOMP_SPINCOUNT, which libgomp reads as torch loads
import torch

from kt_cli import LLM, SamplingParams
from kt_cli.placement import place

TEXT = Path(__file__).resolve().parents[2] / "shared" / "reference" / "kjv_genesis_1-10.txt"
VOCAB = 512
STRATEGIES = ("uniform", "frequency", "front-loading", "random")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--inter", type=int, default=384)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--text-tokens", type=int, default=1024, help="tokens of each half of the text used")
    p.add_argument("--budget", type=float, default=0.25, help="share of experts on the device for the hit rates")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache", type=Path, default=Path("/tmp/kt-bench-placement"))
    return p.parse_args()


def build_checkpoint(args) -> Path:
    """A random Qwen3-MoE saved by transformers (fan-in scaled weights: routing far from uniform)."""
    import transformers
    directory = args.cache / f"qwen3moe-l{args.layers}-h{args.hidden}-e{args.experts}-k{args.top_k}-i{args.inter}"
    if (directory / "config.json").exists():
        return directory
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=args.hidden // 8, intermediate_size=4 * args.inter,
        moe_intermediate_size=args.inter, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 if p.dim() >= 2 else 1.0 + 0.1 * torch.randn(p.shape))
    model.save_pretrained(directory)
    save_byte_tokenizer(directory)
    return directory


def save_byte_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    to_unicode = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={to_unicode[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=to_unicode[0]).save_pretrained(directory)


def decode_tokens_per_second(llm: LLM, n: int) -> float:
    engine = llm.engine
    engine.add_request([65], SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True))
    engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return n / (time.perf_counter() - start)


def decode_table(llm: LLM, args) -> list[dict]:
    rows, shape = [], llm.placement.shape
    for share in (0.0, 0.25, 0.5, 1.0):
        llm.placement.apply(place("uniform", round(share * shape[0] * shape[1]), shape))
        decode_tokens_per_second(llm, 2)                       # warm-up
        llm.placement.reset()
        rates = [decode_tokens_per_second(llm, args.decode_tokens) for _ in range(args.repeats)]
        stats = llm.stats()
        per_call = {k: v / stats.times.calls * 1e3 for k, v in vars(stats.times).items() if k.endswith("_s")}
        rows.append(dict(share=share, tps=statistics.median(rates), hit=stats.hit_rate, ms=per_call,
                         mib=stats.device_bytes / 2**20, blocked=stats.times.blocked / stats.times.calls))
    return rows


def text_halves(n: int) -> tuple[list[int], list[int]]:
    data = TEXT.read_bytes()
    half = len(data) // 2
    return list(data[:half][:n]), list(data[half:][:n])


def hit_rate_on(llm: LLM, tokens: list[int]) -> float:
    llm.placement.reset()
    llm.logits([tokens], start=len(tokens) - 1)
    return llm.stats().hit_rate


def hit_table(llm: LLM, args) -> dict:
    record, measure = text_halves(args.text_tokens)
    runtime, shape = llm.placement, llm.placement.shape
    cells = round(args.budget * shape[0] * shape[1])
    runtime.reset()
    llm.logits([record], start=len(record) - 1)
    recorded = runtime.counts().clone()
    hits = {}
    for strategy in STRATEGIES:
        runtime.apply(place(strategy, cells, shape, recorded, seed=0))
        hits[strategy] = hit_rate_on(llm, measure)
    runtime.apply(place("uniform", cells, shape))
    runtime.enable_dynamic(prefill_tokens=64)
    hits["prefill re-placement (uniform start)"] = hit_rate_on(llm, measure)
    for block in runtime.blocks:
        block.replacer = None
    own = runtime.counts().clone()
    runtime.apply(place("frequency", cells, shape, own))
    hits["oracle (frequency on the measured text)"] = hit_rate_on(llm, measure)
    return dict(cells=cells, total=shape[0] * shape[1], tokens=len(measure), hits=hits)


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    directory = build_checkpoint(args)
    llm = LLM(str(directory), device=args.device, ctx=4096, max_batch=1, max_step_tokens=512, kv_memory_gb=0.25)
    print(f"model: random Qwen3-MoE, {args.layers} layers, hidden {args.hidden}, {args.experts} experts, "
          f"top-{args.top_k}, expert intermediate {args.inter}, bf16 in RAM; device {args.device} "
          f"(ready in {time.perf_counter() - t0:.0f} s); load {open('/proc/loadavg').read().split()[0]}")
    print("\ndecode, batch 1 (ms are per MoE layer call)")
    print(f"{'device share':>12} {'tok/s':>7} {'hit':>6} {'MiB dev':>8} {'cpu exp':>8} {'cpu wait':>8} "
          f"{'device':>7} {'transfer':>8} {'overlap':>7} {'blocked':>7}")
    for r in decode_table(llm, args):
        ms = r["ms"]
        print(f"{r['share']:>12.0%} {r['tps']:>7.2f} {r['hit']:>6.1%} {r['mib']:>8.0f} {ms['cpu_s']:>8.3f} "
              f"{ms['cpu_wait_s']:>8.3f} {ms['device_s']:>7.3f} {ms['transfer_s']:>8.3f} {ms['overlap_s']:>7.3f} "
              f"{r['blocked']:>7.0%}")
    result = hit_table(llm, args)
    print(f"\nhit rate, {result['cells']} of {result['total']} experts on the device; statistics recorded on "
          f"the first half of {TEXT.name}, measured on {result['tokens']} tokens of the second half")
    for name, hit in result["hits"].items():
        print(f"  {name:<42} {hit:6.1%}")


if __name__ == "__main__":
    main()
