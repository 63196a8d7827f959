"""What users see of expert placement: per-layer device/CPU split, hit rate, time split."""

from dataclasses import asdict, dataclass

from ..layers.moe import MoETimes
from .dynamic import ReplacementLog


@dataclass(frozen=True)
class LayerStats:
    layer: int              # decoder layer index
    device_experts: int
    cpu_experts: int
    assignments: int        # routed (token, expert) pairs seen
    device_hits: int        # of those, served by a device-resident expert

    @property
    def hit_rate(self) -> float:
        return self.device_hits / self.assignments if self.assignments else 0.0


@dataclass(frozen=True)
class PlacementStats:
    strategy: str
    budget: str
    layers: tuple[LayerStats, ...]
    device_bytes: int
    times: MoETimes
    moves: ReplacementLog

    @property
    def device_experts(self) -> int:
        return sum(s.device_experts for s in self.layers)

    @property
    def total_experts(self) -> int:
        return sum(s.device_experts + s.cpu_experts for s in self.layers)

    @property
    def hit_rate(self) -> float:
        assignments = sum(s.assignments for s in self.layers)
        return sum(s.device_hits for s in self.layers) / assignments if assignments else 0.0

    @property
    def overlap_fraction(self) -> float:
        """Share of the device work done while the CPU experts were still running."""
        return self.times.overlap_s / self.times.device_s if self.times.device_s > 0 else 0.0

    def to_dict(self) -> dict:
        layers = [dict(asdict(s), hit_rate=s.hit_rate) for s in self.layers]
        return {"strategy": self.strategy, "budget": self.budget, "device_experts": self.device_experts,
                "total_experts": self.total_experts, "device_bytes": self.device_bytes,
                "hit_rate": self.hit_rate, "overlap_fraction": self.overlap_fraction,
                "times": asdict(self.times), "moves": asdict(self.moves), "layers": layers}

    def summary(self) -> str:
        """One line for the startup log."""
        if not self.layers:
            return "no routed experts"
        split = ", ".join(f"L{s.layer}:{s.device_experts}" for s in self.layers)
        return (f"{self.device_experts} of {self.total_experts} routed experts on the device "
                f"({self.strategy}; {self.budget}; {self.device_bytes / 2**20:.1f} MiB); per layer {split}")
