"""Server counters and gauges, rendered in the Prometheus text format.

Counters move on two threads: HTTP statuses on the event loop, tokens and engine gauges on
the engine thread (after each step). Each value has one writer, so no lock is needed."""

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

TOKEN_RATE_WINDOW_S = 10.0


@dataclass
class EngineGauges:
    waiting: int = 0
    running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    restored_blocks: int = 0
    preemptions: int = 0


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)          # (endpoint, status) -> count
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    in_flight: int = 0
    engine: EngineGauges = field(default_factory=EngineGauges)
    tiers: dict = field(default_factory=dict)                    # tier name -> TierStats
    placement: Callable | None = None                            # -> kt_cli.placement.PlacementStats
    _recent: deque = field(default_factory=deque)                # (time, tokens) in the window

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def count_tokens(self, generated: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.generation_tokens += generated
        self._recent.append((now, generated))
        self._trim(now)

    def count_finished(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.finished_requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_prompt_tokens += cached_tokens

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        recent = [(t, n) for t, n in list(self._recent) if now - t <= TOKEN_RATE_WINDOW_S]
        return sum(n for _, n in recent) / TOKEN_RATE_WINDOW_S

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def render(self) -> str:
        lines: list[str] = []
        _family(lines, "kt_requests_total", "counter", "HTTP requests by endpoint and status",
                [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.requests.items())])
        for name, kind, text, value in self._scalars():
            _family(lines, name, kind, text, [({}, value)])
        _family(lines, "kt_prefix_tier_blocks", "gauge", "KV blocks held per prefix-cache tier",
                [({"tier": name}, stats.blocks) for name, stats in self.tiers.items()])
        _family(lines, "kt_prefix_tier_bytes", "gauge", "bytes held per prefix-cache tier",
                [({"tier": name}, stats.bytes_used) for name, stats in self.tiers.items()])
        for event in ("stored", "loaded", "dropped", "rejected"):
            _family(lines, f"kt_prefix_tier_{event}_total", "counter", f"KV blocks {event} per tier",
                    [({"tier": name}, getattr(stats, event)) for name, stats in self.tiers.items()])
        if self.placement is not None:
            _placement_families(lines, self.placement())
        return "\n".join(lines) + "\n"

    def _scalars(self) -> list[tuple[str, str, str, float]]:
        engine = self.engine
        return [
            ("kt_prompt_tokens_total", "counter", "prompt tokens of finished requests", self.prompt_tokens),
            ("kt_generation_tokens_total", "counter", "tokens generated", self.generation_tokens),
            ("kt_prefix_cache_cached_tokens_total", "counter", "prompt tokens served from the prefix cache",
             self.cached_prompt_tokens),
            ("kt_prefix_cache_hit_rate", "gauge", "cached prompt tokens / prompt tokens", self.prefix_hit_rate),
            ("kt_prefix_cache_restored_blocks_total", "counter", "KV blocks loaded back from a slower tier",
             engine.restored_blocks),
            ("kt_requests_in_flight", "gauge", "requests admitted and not finished", self.in_flight),
            ("kt_queue_length", "gauge", "requests waiting for a batch slot", engine.waiting),
            ("kt_running_batch_size", "gauge", "requests in the running batch", engine.running),
            ("kt_generation_tokens_per_second", "gauge",
             f"tokens generated per second over the last {TOKEN_RATE_WINDOW_S:.0f} s", self.tokens_per_second()),
            ("kt_kv_blocks_used", "gauge", "KV cache blocks in use", engine.kv_blocks_total - engine.kv_blocks_free),
            ("kt_kv_blocks_free", "gauge", "KV cache blocks free (incl. cached, reclaimable)", engine.kv_blocks_free),
            ("kt_preemptions_total", "counter", "sequences preempted for lack of KV blocks", engine.preemptions),
        ]

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > TOKEN_RATE_WINDOW_S:
            self._recent.popleft()


def _placement_families(lines: list[str], stats) -> None:
    layers = stats.layers
    _family(lines, "kt_expert_device_hit_rate", "gauge",
            "routed (token, expert) pairs served by device-resident experts / all", [({}, stats.hit_rate)])
    _family(lines, "kt_experts_on_device", "gauge", "routed experts on the device per MoE layer",
            [({"layer": str(s.layer)}, s.device_experts) for s in layers])
    _family(lines, "kt_experts_on_cpu", "gauge", "routed experts in RAM (CPU kernels) per MoE layer",
            [({"layer": str(s.layer)}, s.cpu_experts) for s in layers])
    _family(lines, "kt_expert_layer_hit_rate", "gauge", "device hit rate per MoE layer",
            [({"layer": str(s.layer)}, s.hit_rate) for s in layers])
    times = stats.times
    parts = {"cpu_experts": times.cpu_s, "cpu_wait": times.cpu_wait_s, "device": times.device_s,
             "transfer": times.transfer_s, "overlap": times.overlap_s}
    _family(lines, "kt_moe_seconds_total", "counter",
            "MoE layer time by part (cpu_experts and overlap: lower bounds, exact when the CPU outlasts the device)",
            [({"part": part}, seconds) for part, seconds in parts.items()])
    _family(lines, "kt_moe_overlap_fraction", "gauge", "share of device MoE work overlapped with CPU experts",
            [({}, stats.overlap_fraction)])
    _family(lines, "kt_expert_moves_total", "counter", "experts moved between RAM and the device",
            [({}, stats.moves.experts_moved)])


def _family(lines: list[str], name: str, kind: str, text: str, samples: list[tuple[dict, float]]) -> None:
    lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{label_text}}} {_number(value)}" if label_text else f"{name} {_number(value)}")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
