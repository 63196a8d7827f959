"""Placement strategies: a budget of device cells -> a mask [L, E] over (MoE layer, expert).

Every strategy is deterministic; ties are broken by the lower flat index (layer-major),
so the same inputs give the same mask on every machine."""

import torch

from .errors import PlacementError

STRATEGIES = ("uniform", "frequency", "front-loading", "random")


def per_layer_counts(cells: int, num_layers: int, num_experts: int) -> list[int]:
    """`cells` spread evenly over the layers, the remainder to the first layers, each capped at E."""
    cells = min(cells, num_layers * num_experts)
    base, extra = divmod(cells, num_layers)
    return [min(base + (i < extra), num_experts) for i in range(num_layers)]


def rank_by_count(counts: torch.Tensor) -> torch.Tensor:
    """counts [N] -> indices [N], most counted first, ties by the lower index."""
    return torch.sort(-counts.to(torch.float64), stable=True).indices


def uniform(cells: int, shape: tuple[int, int], counts: torch.Tensor | None = None) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool)
    for layer, n in enumerate(per_layer_counts(cells, *shape)):
        mask[layer, :n] = True
    return mask


def frequency(cells: int, shape: tuple[int, int], counts: torch.Tensor | None = None) -> torch.Tensor:
    if counts is None:
        raise PlacementError("frequency placement needs expert statistics (--expert-stats FILE)")
    flat = torch.zeros(shape[0] * shape[1], dtype=torch.bool)
    flat[rank_by_count(counts.reshape(-1))[:cells]] = True
    return flat.view(shape)


def front_loading(cells: int, shape: tuple[int, int], counts: torch.Tensor | None = None) -> torch.Tensor:
    """Whole layers from the first MoE layer up; inside the last, partly filled layer the most
    counted experts (or the lowest ids without statistics)."""
    num_layers, num_experts = shape
    mask = torch.zeros(shape, dtype=torch.bool)
    full, rest = divmod(min(cells, num_layers * num_experts), num_experts)
    mask[:full] = True
    if rest:
        order = torch.arange(num_experts) if counts is None else rank_by_count(counts[full])
        mask[full, order[:rest]] = True
    return mask


def random_cells(cells: int, shape: tuple[int, int], counts: torch.Tensor | None = None,
                 seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    flat = torch.zeros(shape[0] * shape[1], dtype=torch.bool)
    flat[torch.randperm(flat.numel(), generator=generator)[:cells]] = True
    return flat.view(shape)


def place(strategy: str, cells: int, shape: tuple[int, int], counts: torch.Tensor | None = None,
          seed: int = 0) -> torch.Tensor:
    """-> bool [L, E], True where the expert lives on the device; exactly min(cells, L*E) True."""
    if strategy not in STRATEGIES:
        raise PlacementError(f"unknown placement {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if counts is not None and tuple(counts.shape) != tuple(shape):
        raise PlacementError(f"expert statistics have shape {tuple(counts.shape)}, the model needs {tuple(shape)}")
    cells = max(0, min(int(cells), shape[0] * shape[1]))
    if strategy == "random":
        return random_cells(cells, shape, counts, seed)
    builders = {"uniform": uniform, "frequency": frequency, "front-loading": front_loading}
    return builders[strategy](cells, shape, counts)
