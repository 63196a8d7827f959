"""Serving figures for `kt run`: output tokens/s and time-to-first-token / inter-token latency
percentiles at several concurrencies, then TTFT of a long prompt without and with a
prefix-cache hit (in the KV pool, and from the disk tier after a restart).

It starts the server itself (python -m kt_cli.server) on a free loopback port. Without
--model it builds a random-weight Qwen3-MoE scaled down to laptop size (once, in --work-dir)
with the SmolLM2 tokenizer.

    python bench/serve.py [--model PATH] [--concurrency 1 4 16] [--max-tokens 64] [--threads 2]
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kt_cli import store

START_TIMEOUT_S = 600
SCALED_QWEN3_MOE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=64, intermediate_size=1024, moe_intermediate_size=256, num_experts=32,
                        num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
                        tie_word_embeddings=False)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model to serve (default: a random scaled Qwen3-MoE built in --work-dir)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/kt-bench-serve"))
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int)
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def scaled_qwen3_moe(directory: Path) -> Path:
    if (directory / "config.json").exists():
        return directory
    import torch
    import transformers

    from kt_weights.checkpoint import open_checkpoint
    with open_checkpoint(store.default_model_path()) as ckpt:
        tokenizer = ckpt.tokenizer()
    config = transformers.Qwen3MoeConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                         eos_token_id=tokenizer.eos_token_id, **SCALED_QWEN3_MOE)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 if p.dim() >= 2 else 1.0 + 0.1 * torch.randn(p.shape))
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


class Server:
    def __init__(self, model: str, cache_dir: Path, log: Path, threads: int | None, max_batch: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "kt_cli.server", "--model", model, "--port", str(self.port),
                "--max-batch", str(max_batch), "--max-queue", "256", "--prefix-cache-disk", str(cache_dir),
                "--shutdown-timeout-s", "5", *(["--threads", str(threads)] if threads else [])]
        self.proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env=dict(os.environ, HF_HUB_OFFLINE="1"))
        self._wait(log)

    def _wait(self, log: Path) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"server exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        sys.exit("server did not become healthy")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class Timing:
    ttft: float
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


async def stream_one(client: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int) -> Timing:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return Timing(arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:])], tokens)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


async def concurrency_round(server: Server, clients: int, args, rng: random.Random) -> dict:
    async def client_loop(client):
        return [await stream_one(client, server, random_prompt(rng, args.prompt_tokens), args.max_tokens)
                for _ in range(args.requests_per_client)]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        start = time.perf_counter()
        per_client = await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - start
    timings = [t for group in per_client for t in group]
    gaps = [g for t in timings for g in t.gaps]
    return {"concurrency": clients, "requests": len(timings), "output_tok_s": sum(t.tokens for t in timings) / wall,
            **_percentiles("ttft_ms", [t.ttft * 1e3 for t in timings]), **_percentiles("itl_ms", [g * 1e3 for g in gaps])}


def _percentiles(name: str, values: list[float]) -> dict:
    if not values:
        return {f"{name}_p50": float("nan"), f"{name}_p90": float("nan"), f"{name}_p99": float("nan")}
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {f"{name}_p50": cuts[49], f"{name}_p90": cuts[89], f"{name}_p99": cuts[98]}


async def prefix_ttft(server: Server, prefix: list[int], suffix_seed: int) -> tuple[float, int]:
    body = {"model": server.model, "prompt": prefix + [1000 + suffix_seed, 2000 + suffix_seed], "max_tokens": 1,
            "temperature": 0.0}
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        reply = (await client.post(f"{server.url}/v1/completions", json=body)).json()
    return time.perf_counter() - start, reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def print_table(model: str, rounds: list[dict], prefix_rows: list[tuple[str, float, int]]) -> None:
    print(f"model: {model}   load average: {os.getloadavg()[0]:.1f}")
    head = f"{'conc':>4} {'reqs':>4} {'out tok/s':>9} {'TTFT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>22}"
    print(head)
    print("-" * len(head))
    for r in rounds:
        ttft = f"{r['ttft_ms_p50']:.0f}/{r['ttft_ms_p90']:.0f}/{r['ttft_ms_p99']:.0f}"
        itl = f"{r['itl_ms_p50']:.1f}/{r['itl_ms_p90']:.1f}/{r['itl_ms_p99']:.1f}"
        print(f"{r['concurrency']:>4} {r['requests']:>4} {r['output_tok_s']:>9.1f} {ttft:>22} {itl:>22}")
    print()
    for what, seconds, cached in prefix_rows:
        print(f"TTFT {what:<34} {seconds * 1e3:8.0f} ms   cached tokens {cached}")


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or str(scaled_qwen3_moe(args.work_dir / "qwen3_moe_scaled"))
    cache_dir = args.work_dir / f"prefix_cache_{os.getpid()}"
    server = Server(model, cache_dir, args.work_dir / "server.log", args.threads, max(args.concurrency))
    rng = random.Random(0)
    try:
        asyncio.run(prefix_ttft(server, random_prompt(rng, 32), 0))   # warm-up
        rounds = [asyncio.run(concurrency_round(server, c, args, rng)) for c in args.concurrency]
        prefix = random_prompt(rng, args.prefix_tokens)
        prefix_rows = [("cold (no hit)", *asyncio.run(prefix_ttft(server, prefix, 1))),
                       ("prefix hit in the KV pool", *asyncio.run(prefix_ttft(server, prefix, 2)))]
    finally:
        server.stop()
    server = Server(model, cache_dir, args.work_dir / "server2.log", args.threads, max(args.concurrency))
    try:
        prefix_rows.append(("prefix hit from disk (after restart)", *asyncio.run(prefix_ttft(server, prefix, 3))))
    finally:
        server.stop()
    shutil.rmtree(cache_dir, ignore_errors=True)
    if args.json:
        print(json.dumps({"model": model, "rounds": rounds, "prefix": prefix_rows}, indent=2))
    else:
        print_table(model, rounds, prefix_rows)


if __name__ == "__main__":
    main()
