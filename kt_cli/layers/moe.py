"""A sparse MoE block: router -> routed experts on the CPU through kt's fused
operator (asynchronous), while the shared expert and the device-resident experts
run in torch; then the results are summed.

Expert placement: `on_device` [E] bool says which routed experts live on the model's
device (dequantized into the compute dtype there, computed in torch); their ids reach
the CPU operator as -1, which skips them. The CPU operator keeps every expert (in its
kernel layout, or for float experts the checkpoint's mapping) and the device copies are
made from those, so an expert can move between tiers at any time: `set_placement(row)`
uploads or drops device copies and updates `on_device` in place (it may be a view of a
model-wide [L, E] mask).

One forward, and what each timer covers:
  router(x) -> ids, weights                      (device)
  ids/x/weights to the CPU, submit CPU experts    transfer_s
  shared + device experts                         device_s   } overlap_s: both busy
  wait for the CPU experts                        cpu_wait_s }
  CPU result to the device, sum                   transfer_s"""

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from kt_weights.layout import QMatrix

from ..errors import ModelError
from ..ops.moe import MoEExperts
from .linear import Linear, Target
from .mlp import GatedMLP, activation

ExpertWeights = tuple[list[QMatrix], list[QMatrix], list[QMatrix]]   # gate, up, down per expert
BLOCKED_WAIT_S = 50e-6     # a wait() longer than this found the CPU experts still running (a finished
                           # job's sync measured 5-40 us on a loaded 2-core machine)


def cpu_experts(weights: ExpertWeights, act: str):
    return MoEExperts(*weights, activation=act)


class DeviceExperts(torch.nn.Module):
    """Device copies of the experts currently placed there, in the compute dtype."""

    def __init__(self, source: Callable[[int], tuple[torch.Tensor, ...]], target: Target, act: str):
        """source(e): expert e's gate, up and down in float32 (MoEExperts.dequantized)"""
        super().__init__()
        self.source, self.target, self.act = source, target, activation(act)
        self.resident: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def upload(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device copies of expert e (safe to call from another thread)."""
        return tuple(self.target.put(t) for t in self.source(e))

    def install(self, e: int, tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.resident[e] = tensors

    def place(self, e: int) -> None:
        self.install(e, self.upload(e))

    def evict(self, e: int) -> None:
        del self.resident[e]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for mats in self.resident.values() for t in mats)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, on: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] and weights [T, K] on the device; ids [T, K] and on [T, K] bool on the CPU -> [T, H]"""
        out = torch.zeros_like(x)
        tok, slot = on.nonzero(as_tuple=True)
        if tok.numel() == 0:
            return out
        experts = ids[tok, slot]
        order = experts.argsort(stable=True)
        experts, counts = experts[order].unique_consecutive(return_counts=True)
        tok, slot = tok[order].to(x.device), slot[order].to(x.device)
        scale = weights[tok, slot].to(x.dtype)
        start = 0
        for e, n in zip(experts.tolist(), counts.tolist()):
            rows = tok[start:start + n]
            gate, up, down = self.resident[e]
            xe = x[rows]
            h = self.act(xe @ gate.T) * (xe @ up.T)
            out.index_add_(0, rows, (h @ down.T) * scale[start:start + n, None])
            start += n
        return out


class SharedExpert(torch.nn.Module):
    """Always-on expert(s); Qwen2-MoE scales it by sigmoid(gate(x))."""

    def __init__(self, mlp: GatedMLP, gate: Linear | None = None):
        super().__init__()
        self.mlp, self.gate = mlp, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y


@dataclass
class MoETimes:
    """Seconds summed over forward calls. cpu_s and overlap_s are exact for the `blocked` calls
    (the CPU experts outlived the device work); the other calls add 0 to both (lower bounds)."""
    calls: int = 0
    blocked: int = 0
    transfer_s: float = 0.0
    device_s: float = 0.0
    cpu_wait_s: float = 0.0
    cpu_s: float = 0.0
    overlap_s: float = 0.0

    def add(self, other: "MoETimes") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class ExpertUsage:
    """Routed (token, expert) assignments of one layer, and how many the device served."""

    def __init__(self, num_experts: int):
        self.routed = torch.zeros(num_experts, dtype=torch.int64)
        self.device_hits = 0
        self.assignments = 0
        self._ones = torch.ones(0, dtype=torch.int64)

    def count(self, ids: torch.Tensor, on: torch.Tensor | None, routed_counted: bool = False) -> None:
        """ids [T, K] routed experts; on [T, K] True where the device served them (None: nowhere);
        routed_counted: the router added ids to `routed` itself (SoftmaxTopK.counts)"""
        n = ids.numel()
        if not routed_counted:
            if self._ones.numel() < n:
                self._ones = torch.ones(n, dtype=torch.int64)
            self.routed.index_add_(0, ids.flatten(), self._ones[:n])
        self.device_hits += 0 if on is None else int(on.sum())
        self.assignments += n

    def reset(self) -> None:
        self.routed.zero_()
        self.device_hits = self.assignments = 0


class _DeviceClock:
    """The instants of one forward: begun (router done), t0 (CPU experts submitted), t1 (device
    work issued), finished (CPU experts done). The device work is timed with CUDA events on a
    GPU (launches are asynchronous), in wall time otherwise."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda else None

    def begin(self) -> None:
        self.begun = time.perf_counter()

    def start(self) -> None:
        if self.cuda:
            self.events[0].record()
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.events[1].record()
        self.t1 = time.perf_counter()

    def done(self) -> None:
        self.finished = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1]) / 1000.0
        return self.t1 - self.t0


class MoEBlock(torch.nn.Module):
    def __init__(self, router: torch.nn.Module, experts: ExpertWeights, target: Target,
                 shared: SharedExpert | None = None, on_device: list[bool] | None = None, act: str = "silu"):
        super().__init__()
        self.router, self.shared = router, shared
        self.num_experts = len(experts[0])
        self.cpu = cpu_experts(experts, act)
        self.device_experts = DeviceExperts(self.cpu.dequantized, target, act)
        self.on_device = torch.zeros(self.num_experts, dtype=torch.bool)
        self.usage, self.times = ExpertUsage(self.num_experts), MoETimes()
        self.clock = _DeviceClock(target.device)
        self.replacer = None        # optional hook: replacer.before_dispatch(block, ids [T, K] cpu)
        # a CPU SoftmaxTopK counts its choices itself, in its native routing call
        self.router_counts = hasattr(router, "count_into") and router.count_into(self.usage.routed)
        self.set_placement(_placement_mask(on_device, self.num_experts))

    def set_placement(self, row: torch.Tensor) -> int:
        """Moves experts so that the device holds exactly `row` [E] bool; -> experts moved."""
        row = torch.as_tensor(row, dtype=torch.bool).cpu()
        if row.shape != self.on_device.shape:
            raise ModelError(f"expert placement mask has {row.numel()} entries for {self.num_experts} experts")
        leaving, arriving = (self.on_device & ~row).nonzero().flatten(), (row & ~self.on_device).nonzero().flatten()
        for e in leaving.tolist():
            self.device_experts.evict(e)
        for e in arriving.tolist():
            self.device_experts.place(e)
        self.on_device.copy_(row)
        return len(leaving) + len(arriving)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]"""
        weights, ids = self.router.forward(x)               # [T, K] f32, [T, K] int64
        self.clock.begin()
        ids = ids.cpu()
        if self.replacer is not None:
            self.replacer.before_dispatch(self, ids)
        on = self.on_device[ids] if self.device_experts.resident else None     # [T, K] bool
        job = self.cpu.submit(_cpu_f32(x), (ids if on is None else ids.masked_fill(on, -1)).to(torch.int32),
                              _cpu_f32(weights))
        self.clock.start()
        out = self.shared.forward(x) if self.shared is not None else None
        if on is not None:
            device = self.device_experts.forward(x, ids, on, weights)
            out = device if out is None else out + device
        self.clock.stop()
        routed = job.wait()
        self.clock.done()
        if routed.device != x.device or routed.dtype != x.dtype:
            routed = routed.to(device=x.device, dtype=x.dtype)
        out = routed if out is None else out + routed
        self._account(cpu_work=on is None or not bool(on.all()))
        self.usage.count(ids, on, self.router_counts)
        return out

    def native_decode_ok(self) -> bool:
        """Whether this call may run as kt_decode_moe_f32 (kt_cli.layers.decode_moe): every
        routed expert on the CPU, no shared expert, no placement hook, routing counted natively."""
        return (self.router_counts and self.shared is None and self.replacer is None
                and not self.device_experts.resident)

    def account_native(self, tokens: int, seconds: float) -> None:
        """The bookkeeping of forward() for a call kt_decode_moe_f32 ran (it added the routed
        counts itself): all of it was CPU work the caller waited for."""
        self.usage.assignments += tokens * self.router.top_k
        times = self.times
        times.calls += 1
        times.cpu_wait_s += seconds
        if seconds > BLOCKED_WAIT_S:
            times.blocked += 1
            times.cpu_s += seconds

    def _account(self, cpu_work: bool) -> None:
        clock, times = self.clock, self.times
        times.calls += 1
        times.transfer_s += (clock.t0 - clock.begun) + (time.perf_counter() - clock.finished)
        times.cpu_wait_s += (wait_s := clock.finished - clock.t1)
        times.device_s += (device_s := clock.seconds())
        if cpu_work and wait_s > BLOCKED_WAIT_S:
            times.blocked += 1
            times.cpu_s += (cpu_s := clock.finished - clock.t0)
            times.overlap_s += min(device_s, cpu_s)


def _cpu_f32(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu" or t.dtype != torch.float32:
        t = t.to(device="cpu", dtype=torch.float32)
    return t.contiguous()


def _placement_mask(on_device, num_experts: int) -> torch.Tensor:
    if on_device is None:
        return torch.zeros(num_experts, dtype=torch.bool)
    if len(on_device) != num_experts:
        raise ModelError(f"expert placement mask has {len(on_device)} entries for {num_experts} experts")
    return torch.tensor([bool(b) for b in on_device], dtype=torch.bool)
