"""rich renderings of kt's reports; the commands in cli.py call these."""

from rich.console import Console
from rich.table import Table

STATUS_STYLE = {"ok": "[green]OK[/]", "warn": "[yellow]WARN[/]", "error": "[red]ERROR[/]"}


def doctor(report: dict, console: Console) -> None:
    console.print(f"[bold]kt {report['versions']['kt']}[/] · Python {report['versions']['python']}"
                  f" · torch {report['versions']['torch']}")
    console.print(_checks_table(report["checks"]))
    console.print(_features_table(report["cpu"]["features"]))
    console.print(_variants_table(report["kernels"]))
    if report["expected"]:
        console.print(_expected_table(report["expected"], report["memory"]["read_bandwidth_gbps"]))


def _checks_table(checks: list[dict]) -> Table:
    table = Table(title="Checks", show_lines=False)
    for col in ("check", "status", "detail", "hint"):
        table.add_column(col)
    for c in checks:
        table.add_row(c["name"], STATUS_STYLE[c["status"]], c["detail"], c["hint"])
    return table


def _features_table(features: dict) -> Table:
    table = Table(title="CPU features")
    for col in ("feature", "CPU", "OS enabled"):
        table.add_column(col)
    for name, v in features.items():
        table.add_row(name, _yes(v["cpu"]), _yes(v["os"]))
    return table


def _variants_table(kern: dict) -> Table:
    table = Table(title=f"Kernel variants (loaded: {kern['selected']} - {kern['reason']})")
    for col in ("variant", "built", "runs here", "why"):
        table.add_column(col)
    for v in kern["variants"]:
        name = f"[bold green]{v['variant']}[/]" if v["variant"] == kern["selected"] else v["variant"]
        table.add_row(name, _yes(v["built"]), _yes(v["runnable"]), v["reason"])
    return table


def _expected_table(rows: list[dict], gbps: float) -> Table:
    table = Table(title=f"Expected decode speed (bandwidth-bound, {gbps} GB/s measured)")
    table.add_column("model")
    table.add_column("tokens/s", justify="right")
    for r in rows:
        table.add_row(r["model"], f"~{r['decode_tokens_per_s']}")
    return table


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[dim]no[/]"


def perplexity(result: dict, console: Console) -> None:
    console.print(f"[bold]perplexity[/] {result['ppl']:.4f} ± {result['ppl_stderr']:.4f}  "
                  f"({result['n_chunks']} chunks of {result['n_ctx']} tokens, {result['n_scored']} scored; "
                  f"{result['tokens_per_second']} tokens/s)")


class ConvertProgress:
    """A rich progress bar per converted layer, driven by source bytes (ETA, MB/s)."""

    def __init__(self, console: Console):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=console)
        self.task = None

    def start(self, info) -> None:
        self.progress.start()
        self.progress.console.print(
            f"{info.units} units, {info.source_bytes / 1e6:.0f} MB in, ~{info.estimated_output_bytes / 1e6:.0f} MB out, "
            f"{info.free_disk_bytes / 1e9:.1f} GB free, {info.threads} threads"
            + (f", resuming after {info.resumed_units}" if info.resumed_units else ""))
        self.task = self.progress.add_task("converting", total=info.source_bytes)

    def unit_done(self, unit) -> None:
        self.progress.update(self.task, advance=unit.source_bytes, description=unit.name)

    def stop(self) -> None:
        self.progress.stop()


def convert_summary(rows: list[tuple[str, str]], console: Console) -> None:
    table = Table(title="kt convert", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)
