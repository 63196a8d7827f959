"""What `kt run` needs to know, checked once at construction."""

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from ..errors import KtError
from ..store import default_model_path


class ServeOptionsError(KtError):
    pass


@dataclass(frozen=True)
class ServeOptions:
    """model: GGUF file, HF / kt directory or cached repo id (default: kt's default model).
    api_key: when set, every /v1 request must send 'Authorization: Bearer <api_key>'.
    max_batch: sequences decoded together; max_queue: requests waiting beyond those (then 503).
    ctx / kv_memory_gb / threads / max_step_tokens / device: passed to the engine (None: its defaults).
    prefix_cache_disk: directory for KV blocks evicted from the cache (off when None), bounded
    by prefix_cache_disk_gb; prefix_cache_ram_gb: host-RAM tier used when the KV cache is on a GPU.
    served_model_name: the name clients must send (default: the model's file or directory name).
    gpu_experts .. decode_replace_tokens: routed-expert placement, passed to the LLM (see LLMOptions)."""
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_batch: int = 8
    max_queue: int = 64
    ctx: int | None = None
    threads: int | None = None
    kv_memory_gb: float | None = None
    max_step_tokens: int = 512
    device: str = "cpu"
    prefix_cache_disk: Path | None = None
    prefix_cache_disk_gb: float = 10.0
    prefix_cache_ram_gb: float = 4.0
    shutdown_timeout_s: float = 10.0
    log_level: str = "warning"
    gpu_experts: int | None = None
    gpu_experts_ratio: float | None = None
    placement: str = "uniform"
    expert_stats: Path | None = None
    record_expert_stats: Path | None = None
    prefill_replace_tokens: int | None = None
    decode_replace_tokens: int | None = None

    def __post_init__(self):
        if self.model is None:
            object.__setattr__(self, "model", str(default_model_path()))
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ServeOptionsError("model must be a path or a repo id")
        object.__setattr__(self, "model", str(self.model))
        if self.prefix_cache_disk is not None:
            object.__setattr__(self, "prefix_cache_disk", Path(self.prefix_cache_disk).expanduser())
        if self.api_key == "":
            object.__setattr__(self, "api_key", None)
        for problem in self._problems():
            raise ServeOptionsError(problem)
        self.placement_options()

    def placement_options(self) -> dict:
        """The LLM keyword arguments for expert placement (validated here)."""
        from ..placement import PlacementError, PlacementOptions
        options = dict(gpu_experts=self.gpu_experts, gpu_experts_ratio=self.gpu_experts_ratio,
                       placement=self.placement, expert_stats=self.expert_stats,
                       record_expert_stats=self.record_expert_stats,
                       prefill_replace_tokens=self.prefill_replace_tokens,
                       decode_replace_tokens=self.decode_replace_tokens)
        try:
            PlacementOptions(**{("strategy" if k == "placement" else k): v for k, v in options.items()})
        except PlacementError as err:
            raise ServeOptionsError(str(err)) from None
        return options

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def name_to_serve(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model)
        return path.name if path.exists() else self.model

    def _problems(self) -> list[str]:
        checks = [
            (_valid_host(self.host), f"host must be an IP address or 'localhost', got {self.host!r}"),
            (_int_in(self.port, 0, 65535), f"port must be an integer in 0..65535, got {self.port!r}"),
            (_int_in(self.max_batch, 1), f"max_batch must be an integer >= 1, got {self.max_batch!r}"),
            (_int_in(self.max_queue, 0), f"max_queue must be an integer >= 0, got {self.max_queue!r}"),
            (self.ctx is None or _int_in(self.ctx, 2), f"ctx must be an integer >= 2, got {self.ctx!r}"),
            (self.threads is None or _int_in(self.threads, 1), f"threads must be an integer >= 1, got {self.threads!r}"),
            (_int_in(self.max_step_tokens, 1), f"max_step_tokens must be an integer >= 1, got {self.max_step_tokens!r}"),
            (self.kv_memory_gb is None or _positive(self.kv_memory_gb), f"kv_memory_gb must be > 0, got {self.kv_memory_gb!r}"),
            (_positive(self.prefix_cache_disk_gb), f"prefix_cache_disk_gb must be > 0, got {self.prefix_cache_disk_gb!r}"),
            (_positive(self.prefix_cache_ram_gb, allow_zero=True), f"prefix_cache_ram_gb must be >= 0, got {self.prefix_cache_ram_gb!r}"),
            (_positive(self.shutdown_timeout_s, allow_zero=True), f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s!r}"),
            (self.api_key is None or isinstance(self.api_key, str), "api_key must be a string"),
            (self.served_model_name is None or (isinstance(self.served_model_name, str) and self.served_model_name.strip()),
             "served_model_name must be a non-empty string"),
            (self.log_level in ("critical", "error", "warning", "info", "debug", "trace"),
             f"log_level must be one of critical/error/warning/info/debug/trace, got {self.log_level!r}"),
        ]
        return [message for ok, message in checks if not ok]


def _valid_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except (ValueError, TypeError):
        return False
    return True


def _int_in(value, low: int, high: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


def _positive(value, allow_zero: bool = False) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return value >= 0 if allow_zero else value > 0
