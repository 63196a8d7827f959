"""PlacementRuntime: the model-wide view of expert placement.

It finds the model's MoE blocks, owns the mask [L, E] (each block's `on_device` is a view of
its row, so moves made inside a block show here at once), applies placements, hooks
dynamic re-placement into the blocks, records routed-token counts, and reports stats."""

import atexit
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..layers.moe import MoEBlock, MoETimes
from . import budget as budget_mod
from . import stats as stats_mod
from .dynamic import ReplacementLog, Replacer
from .errors import PlacementError
from .options import PlacementOptions
from .report import LayerStats, PlacementStats
from .strategies import place


def moe_blocks(model: torch.nn.Module) -> list[tuple[int, MoEBlock]]:
    """(decoder layer index, block) of every MoE layer, in order."""
    return [(i, layer.mlp) for i, layer in enumerate(getattr(model, "layers", []))
            if isinstance(getattr(layer, "mlp", None), MoEBlock)]


class PlacementRuntime:
    def __init__(self, model: torch.nn.Module, model_id: str):
        found = moe_blocks(model)
        self.model, self.model_id = model, model_id
        self.layers = tuple(i for i, _ in found)
        self.blocks = [b for _, b in found]
        if len({b.num_experts for b in self.blocks}) > 1:
            raise PlacementError("MoE layers differ in their number of routed experts")
        num_experts = self.blocks[0].num_experts if self.blocks else 0
        self.mask = torch.zeros(len(self.blocks), num_experts, dtype=torch.bool)
        for row, block in enumerate(self.blocks):
            self.mask[row] = block.on_device
            block.on_device = self.mask[row]
        self.strategy, self.budget = "given", budget_mod.Budget(int(self.mask.sum()), "set by ModelOptions")
        self.log, self.executor = ReplacementLog(), None
        self._record_path, self._record_interval, self._last_record = None, 0.0, 0.0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.mask.shape)

    def apply(self, mask: torch.Tensor) -> int:
        """Moves experts between tiers so the device holds `mask` [L, E]; -> experts moved."""
        mask = torch.as_tensor(mask, dtype=torch.bool)
        if tuple(mask.shape) != self.shape:
            raise PlacementError(f"placement mask has shape {tuple(mask.shape)}, the model needs {self.shape}")
        return sum(block.set_placement(mask[row]) for row, block in enumerate(self.blocks))

    def configure(self, options: PlacementOptions, memory: budget_mod.DeviceMemory | None = None) -> None:
        """Initial placement from the options (without a budget or a GPU, a placement the model
        was built with stays), dynamic re-placement and recording."""
        if not self.blocks:
            return
        given = options.gpu_experts is None and options.gpu_experts_ratio is None and memory is None
        if not (given and self.mask.any()):
            self.place(options, memory)
        if options.dynamic:
            self.enable_dynamic(options.prefill_replace_tokens, options.decode_replace_tokens,
                                options.decode_replace_moves)
        if options.record_expert_stats is not None:
            self.record_to(options.record_expert_stats, options.record_interval_s)

    def place(self, options: PlacementOptions, memory: budget_mod.DeviceMemory | None = None) -> int:
        """Budget + strategy -> mask, applied; -> experts moved."""
        self.budget = budget_mod.resolve(*self.shape, options.gpu_experts, options.gpu_experts_ratio, memory)
        counts = self._load_counts(options.expert_stats) if options.expert_stats is not None else None
        self.strategy = options.strategy
        return self.apply(place(options.strategy, self.budget.cells, self.shape, counts, options.seed))

    def enable_dynamic(self, prefill_tokens: int | None, decode_tokens: int | None = None, moves: int = 1) -> None:
        if decode_tokens is not None and self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kt-expert-upload")
        for block in self.blocks:
            block.replacer = Replacer(prefill_tokens, decode_tokens, moves, self.log, self.executor)

    def counts(self) -> torch.Tensor:
        """Routed tokens per (MoE layer, expert) since the start or the last reset: int64 [L, E]."""
        if not self.blocks:
            return torch.zeros(0, 0, dtype=torch.int64)
        return torch.stack([b.usage.routed for b in self.blocks])

    def expert_stats(self) -> stats_mod.ExpertStats:
        return stats_mod.ExpertStats(self.model_id, self.layers, self.counts().clone())

    def save_expert_stats(self, path: str | Path) -> Path:
        return self.expert_stats().save(path)

    def record_to(self, path: str | Path, interval_s: float = 30.0) -> None:
        """Saves the counts every interval_s (checked after each forward) and at exit."""
        first = self._record_path is None
        self._record_path, self._record_interval = Path(path), interval_s
        self._last_record = time.monotonic()
        if first:
            self._record_after_forward()
            atexit.register(self._record_at_exit)

    def _record_after_forward(self) -> None:
        """Checks the interval after every forward (model.forward, and model.greedy_tokens,
        which greedy steps call instead). The engine calls them directly, which module
        forward hooks never see, so the bound methods themselves are wrapped (instance
        attributes: model(...) goes through forward's as well)."""
        for name in ("forward", "greedy_tokens"):
            method = getattr(self.model, name, None)
            if method is not None:
                setattr(self.model, name, self._recording(method))

    def _recording(self, method):
        def recording(*args, **kwargs):
            out = method(*args, **kwargs)
            self._maybe_record()
            return out
        return recording

    def stop_recording(self) -> None:
        self._record_path = None

    def reset(self) -> None:
        for block in self.blocks:
            block.usage.reset()
            block.times = MoETimes()

    def stats(self) -> PlacementStats:
        times = MoETimes()
        for block in self.blocks:
            times.add(block.times)
        layers = tuple(LayerStats(i, int(b.on_device.sum()), b.num_experts - int(b.on_device.sum()),
                                  b.usage.assignments, b.usage.device_hits)
                       for i, b in zip(self.layers, self.blocks))
        device_bytes = sum(b.device_experts.nbytes() for b in self.blocks)
        return PlacementStats(self.strategy, self.budget.reason, layers, device_bytes, times,
                              ReplacementLog(**vars(self.log)))

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None
        self._record_at_exit()

    def _load_counts(self, path: Path) -> torch.Tensor:
        loaded = stats_mod.load(path)
        loaded.check_matches(self.model_id, self.layers, self.shape[1], str(path))
        return loaded.counts

    def _maybe_record(self) -> None:
        now = time.monotonic()
        if self._record_path is not None and now - self._last_record >= self._record_interval:
            self._last_record = now
            self.save_expert_stats(self._record_path)

    def _record_at_exit(self) -> None:
        if self._record_path is not None and self._record_path.parent.is_dir():
            try:
                self.save_expert_stats(self._record_path)
            except OSError:
                pass
