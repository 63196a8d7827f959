"""The `kt` command. Each command parses its options, calls one library
function and renders the result; errors meant for the user become one line on
stderr and a non-zero exit code."""

import json
import sys

import typer
from rich.console import Console

from kt_weights.errors import WeightsError

from . import render
from .errors import KtError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="kt: Mixture-of-Experts inference on your CPU (and GPU).")
stdout = Console()
stderr = Console(stderr=True)


@app.callback()
def root() -> None:
    """kt: Mixture-of-Experts inference on your CPU (and GPU)."""


@app.command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="machine-readable report (schema kt.doctor/1)"),
    no_bandwidth: bool = typer.Option(False, "--no-bandwidth", help="skip the memory bandwidth probe"),
) -> None:
    """Check this machine: CPU features, kernel variant, RAM, bandwidth, GPUs, disk."""
    from . import doctor as doctor_mod
    report = doctor_mod.run(measure_bandwidth=not no_bandwidth).to_dict()
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render.doctor(report, stdout)
    raise typer.Exit(0 if report["ok"] else 1)


@app.command()
def chat(
    model: str = typer.Argument(None, metavar="[MODEL]", help="GGUF file, model directory or cached repo id (default: the default model)"),
    url: str = typer.Option(None, "--url", envvar="KT_URL", help="talk to an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"),
    system: str = typer.Option(None, "--system", help="system prompt"),
    temperature: float = typer.Option(None, "--temperature", help="0 = greedy (default: 0 with --prompt or piped stdin, 0.8 interactive)"),
    top_p: float = typer.Option(0.9, "--top-p"),
    max_tokens: int = typer.Option(None, "--max-tokens", help="reply length cap"),
    seed: int = typer.Option(None, "--seed", help="sampling seed, for repeatable replies"),
    prompt: str = typer.Option(None, "--prompt", help="answer this message, print only the reply, exit"),
    threads: int = typer.Option(None, "--threads", envvar="KT_THREADS", help="kernel threads (in-process model)"),
    ctx: int = typer.Option(None, "--ctx", envvar="KT_CTX", help="context length (in-process model)"),
) -> None:
    """Chat with MODEL in the terminal, streaming; --prompt (or piped stdin) answers once and exits."""
    from .chat import ChatOptions, run_chat
    code = run_chat(ChatOptions(model=model, url=url, system=system, temperature=temperature, top_p=top_p,
                                max_tokens=max_tokens, seed=seed, prompt=prompt, threads=threads, ctx=ctx))
    raise typer.Exit(code)


@app.command("eval")
def eval_(
    model: str = typer.Argument(..., metavar="MODEL", help="GGUF file, model directory or cached repo id"),
    text_file: str = typer.Argument(..., metavar="FILE", help="text to measure perplexity on"),
    ctx: int = typer.Option(512, "--ctx", help="tokens per chunk (second half scored)"),
    threads: int = typer.Option(None, "--threads", envvar="KT_THREADS", help="kernel threads"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable result"),
) -> None:
    """Perplexity of MODEL on FILE, measured the way llama-perplexity does."""
    from . import evaluate
    result = evaluate.perplexity_of_file(model, text_file, ctx=ctx, threads=threads)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        render.perplexity(result, stdout)


@app.command()
def run(
    model: str = typer.Argument(None, metavar="[MODEL]", help="GGUF file, model directory or cached repo id (default: the default model)"),
    host: str = typer.Option("127.0.0.1", "--host", envvar="KT_HOST", help="address to bind (loopback by default)"),
    port: int = typer.Option(8000, "--port", envvar="KT_PORT"),
    api_key: str = typer.Option(None, "--api-key", envvar="KT_API_KEY", help="require 'Authorization: Bearer KEY' on /v1"),
    served_model_name: str = typer.Option(None, "--served-model-name", help="model name clients send (default: file or directory name)"),
    max_batch: int = typer.Option(8, "--max-batch", envvar="KT_MAX_BATCH", help="sequences decoded together"),
    max_queue: int = typer.Option(64, "--max-queue", help="requests waiting beyond the batch (then 503)"),
    ctx: int = typer.Option(None, "--ctx", envvar="KT_CTX", help="context length (default: the model's, capped at 4096)"),
    threads: int = typer.Option(None, "--threads", envvar="KT_THREADS", help="kernel threads (default: physical cores)"),
    kv_memory_gb: float = typer.Option(None, "--kv-memory-gb", help="KV cache budget"),
    max_step_tokens: int = typer.Option(512, "--max-step-tokens", help="token budget per engine step (chunked prefill)"),
    device: str = typer.Option("cpu", "--device", envvar="KT_DEVICE", help="cpu or cuda[:N] for attention/dense parts"),
    prefix_cache_disk: str = typer.Option(None, "--prefix-cache-disk", help="directory for the disk tier of the prefix cache"),
    prefix_cache_disk_gb: float = typer.Option(10.0, "--prefix-cache-disk-gb"),
    prefix_cache_ram_gb: float = typer.Option(4.0, "--prefix-cache-ram-gb", help="host-RAM tier when the KV cache is on a GPU"),
    log_level: str = typer.Option("warning", "--log-level"),
    gpu_experts: int = typer.Option(None, "--gpu-experts", envvar="KT_GPU_EXPERTS", help="routed experts per MoE layer on the GPU (default: auto; 0 without a GPU)"),
    gpu_experts_ratio: float = typer.Option(None, "--gpu-experts-ratio", help="share of all routed experts on the GPU (0..1)"),
    placement: str = typer.Option("uniform", "--placement", help="uniform | frequency | front-loading | random"),
    expert_stats: str = typer.Option(None, "--expert-stats", help="recorded expert statistics, for --placement frequency"),
    record_expert_stats: str = typer.Option(None, "--record-expert-stats", help="write routed-token counts (.json or .safetensors)"),
    prefill_replace_tokens: int = typer.Option(None, "--prefill-replace-tokens", help="re-place device experts on each prefill of >= N tokens"),
    decode_replace_tokens: int = typer.Option(None, "--decode-replace-tokens", help="swap hot experts in every N decode tokens"),
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)."""
    from .server import ServeOptions, serve
    serve(ServeOptions(
        model=model, host=host, port=port, api_key=api_key, served_model_name=served_model_name,
        max_batch=max_batch, max_queue=max_queue, ctx=ctx, threads=threads, kv_memory_gb=kv_memory_gb,
        max_step_tokens=max_step_tokens, device=device, prefix_cache_disk=prefix_cache_disk,
        prefix_cache_disk_gb=prefix_cache_disk_gb, prefix_cache_ram_gb=prefix_cache_ram_gb, log_level=log_level, gpu_experts=gpu_experts,
        gpu_experts_ratio=gpu_experts_ratio, placement=placement, expert_stats=expert_stats,
        record_expert_stats=record_expert_stats, prefill_replace_tokens=prefill_replace_tokens,
        decode_replace_tokens=decode_replace_tokens))


@app.command()
def convert(
    src: str = typer.Argument(..., metavar="SRC", help="Hugging Face model directory or cached repo id"),
    dst: str = typer.Argument(..., metavar="DST", help="output directory (int8/int4/bf16) or .gguf file"),
    to: str = typer.Option(..., "--to", help="int8 | int4 | bf16 | gguf"),
    group_size: int = typer.Option(64, "--group-size", help="weights per scale: 32 | 64 | 128"),
    gguf_type: str = typer.Option(None, "--gguf-type", help="q8_0 | q4_0 | q4_1 | f16 | bf16 | f32 (default q8_0)"),
    experts_only: bool = typer.Option(False, "--experts-only", help="quantize only the routed experts"),
    asymmetric: bool = typer.Option(False, "--asymmetric", help="scale + min per group"),
    threads: int = typer.Option(None, "--threads", envvar="KT_THREADS", help="quantization threads"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run"),
    force: bool = typer.Option(False, "--force", help="replace DST if it exists"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Convert FP8/BF16/FP16 safetensors to kt's INT8/INT4/BF16 layout or to GGUF, one layer at a time."""
    from kt_weights import convert as conv
    options = conv.ConvertOptions(src, dst, to, group_size, gguf_type, experts_only, not asymmetric,
                                  threads, resume, force)
    sink = conv.NullSink() if as_json else render.ConvertProgress(stderr)
    try:
        summary = conv.convert(options, sink)
    finally:
        if not as_json:
            sink.stop()
    if as_json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        render.convert_summary(conv.summary_table_rows(summary), stdout)


def main() -> None:
    try:
        app()
    except (KtError, WeightsError) as exc:
        stderr.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except KeyboardInterrupt:
        sys.exit(130)
