"""serve(options): load the model, hook the prefix-cache tiers under its block pool, print a
summary and run uvicorn until SIGINT/SIGTERM.

Shutdown order: uvicorn stops accepting and gives open requests shutdown_timeout_s to
finish -> the engine loop aborts what is left and its thread ends -> every block the pool
still caches is written to the disk tier, so prefix hits survive a restart."""

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil
import uvicorn
from rich.console import Console
from rich.table import Table

from .. import hardware, kernels
from ..engine.model_runner import kv_bytes_per_token
from ..engine.prefix_store import PrefixStore
from .app import ServerState, create_app
from .engine_loop import EngineLoop
from .metrics import Metrics
from .options import ServeOptions

GIB = 2**30
SHUTDOWN_SLACK_S = 5.0


@dataclass
class Server:
    options: ServeOptions
    llm: object
    store: PrefixStore | None
    state: ServerState

    def run(self) -> None:
        grace = self.options.shutdown_timeout_s
        config = uvicorn.Config(create_app(self.state), host=self.options.host, port=self.options.port,
                                log_level=self.options.log_level, access_log=False,
                                timeout_graceful_shutdown=grace + SHUTDOWN_SLACK_S)
        try:
            _GracefulUvicorn(config, lambda: self.state.loop.begin_shutdown(grace)).run()
        finally:
            self.state.on_shutdown()


class _GracefulUvicorn(uvicorn.Server):
    """uvicorn, but its shutdown first tells the engine loop, which ends open streams cleanly
    (finish_reason 'abort') after the grace period instead of uvicorn cancelling them."""

    def __init__(self, config: uvicorn.Config, on_shutdown_start):
        super().__init__(config)
        self.on_shutdown_start = on_shutdown_start

    async def shutdown(self, sockets=None) -> None:
        self.on_shutdown_start()
        await super().shutdown(sockets)


def serve(options: ServeOptions) -> None:
    """Blocking: serves until SIGINT/SIGTERM."""
    server = load(options)
    print_summary(server, Console())
    server.run()


def load(options: ServeOptions) -> Server:
    from ..llm import LLM

    llm = LLM(options.model, device=options.device, threads=options.threads, max_batch=options.max_batch,
              ctx=options.ctx, kv_memory_gb=options.kv_memory_gb, max_step_tokens=options.max_step_tokens,
              **options.placement_options())
    store = prefix_store(options, llm.engine)
    metrics = Metrics(tiers=store.stats() if store else {}, placement=llm.stats)
    loop = EngineLoop(llm.engine, metrics, options.max_batch + options.max_queue)
    state = ServerState(loop, llm.tokenizer, options.name_to_serve(), llm.ctx, metrics, options.api_key)
    state.on_shutdown = _shutdown_once(loop, store, llm.engine)
    return Server(options, llm, store, state)


def prefix_store(options: ServeOptions, engine) -> PrefixStore | None:
    kv = engine.runner.kv
    on_host = kv.layers[0][0].device.type == "cpu"
    if options.prefix_cache_disk is None and on_host:
        return None
    store = PrefixStore.for_cache(kv, model_fingerprint(options.model), options.prefix_cache_disk,
                                  int(options.prefix_cache_disk_gb * GIB), int(options.prefix_cache_ram_gb * GIB))
    store.install(engine)
    return store


def model_fingerprint(model: str) -> str:
    """Names the weights a KV block was computed from: path, sizes and mtimes of the model files."""
    path = Path(model).expanduser()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=16)
    for file in files:
        if file.exists():
            stat = file.stat()
            digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return f"{path.name}:{digest.hexdigest()}"


def _shutdown_once(loop: EngineLoop, store: PrefixStore | None, engine):
    done = threading.Lock()

    def shutdown() -> None:
        if not done.acquire(blocking=False):
            return
        loop.stop()
        if store is not None:
            store.persist(engine.block_manager)
    return shutdown


def print_summary(server: Server, console: Console) -> None:
    console.print(summary_table(server))
    console.print(f"[bold green]kt is serving[/] {server.state.model_name} at "
                  f"[bold]{server.options.url}/v1[/]  (Ctrl-C to stop)")


def summary_table(server: Server) -> Table:
    table = Table(title="kt run", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for what, value in summary_rows(server):
        table.add_row(what, value)
    return table


def summary_rows(server: Server) -> list[tuple[str, str]]:
    options, engine = server.options, server.llm.engine
    chosen = kernels.load()
    memory = hardware.memory()
    config, blocks = engine.config, engine.block_manager
    kv_bytes = blocks.num_blocks * config.block_size * kv_bytes_per_token(engine.runner.model.kv_specs())
    return [
        ("model", f"{options.model}  (served as '{server.state.model_name}')"),
        ("kernels", f"{chosen.variant}: {chosen.reason}"),
        ("device", options.device),
        ("memory", f"process {psutil.Process().memory_info().rss / GIB:.2f} GiB, "
                   f"free {memory.available_bytes / GIB:.1f} of {memory.total_bytes / GIB:.1f} GiB"),
        ("context", f"{config.ctx} tokens, batch {config.max_batch}, queue {options.max_queue}, "
                    f"step {config.max_step_tokens} tokens"),
        ("KV cache", f"{kv_bytes / GIB:.2f} GiB = {blocks.num_blocks} blocks x {config.block_size} tokens"),
        ("prefix cache", _tiers_text(server.store)),
        ("experts", server.llm.stats().summary()),
        ("API key", "required" if options.api_key else "none (open to anyone who can reach the port)"),
        ("URL", f"{options.url}/v1"),
    ]


def _tiers_text(store: PrefixStore | None) -> str:
    if store is None:
        return "in the KV pool only"
    parts = [f"{tier.name} ({tier.stats.blocks} blocks, cap {tier.capacity_bytes / GIB:.2f} GiB)"
             for tier in store.tiers]
    return "pool -> " + " -> ".join(parts)
