"""Heterogeneous expert placement: which routed experts live on the device (computed in
torch there) and which stay in RAM (kt's CPU kernels), chosen by a budget and a
strategy, moved while serving, and measured.

    options (PlacementOptions) -> budget.resolve -> strategies.place -> mask [L, E]
    -> PlacementRuntime.apply (MoEBlock.set_placement per layer) -> stats() / ExpertStats"""

from .budget import Budget, DeviceMemory, activation_bytes, resolve
from .errors import PlacementError
from .options import PlacementOptions
from .report import LayerStats, PlacementStats
from .runtime import PlacementRuntime, moe_blocks
from .stats import ExpertStats, load
from .strategies import STRATEGIES, place

__all__ = ["STRATEGIES", "Budget", "DeviceMemory", "ExpertStats", "LayerStats", "PlacementError",
           "PlacementOptions", "PlacementRuntime", "PlacementStats", "activation_bytes", "load",
           "moe_blocks", "place", "resolve"]
