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


def main() -> None:
    try:
        app()
    except (KtError, WeightsError) as exc:
        stderr.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except KeyboardInterrupt:
        sys.exit(130)
