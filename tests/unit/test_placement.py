"""Placement strategies, budget arithmetic and options: exact masks for small known inputs."""

import pytest
import torch

from kt_cli.errors import KtError
from kt_cli.placement import DeviceMemory, PlacementError, PlacementOptions, place, resolve
from kt_cli.placement.strategies import per_layer_counts, rank_by_count


def rows(mask: torch.Tensor) -> list[str]:
    return ["".join("x" if b else "." for b in row) for row in mask.tolist()]


def test_uniform_gives_the_remainder_to_the_first_layers():
    assert rows(place("uniform", 7, (3, 4))) == ["xxx.", "xx..", "xx.."]
    assert rows(place("uniform", 0, (2, 3))) == ["...", "..."]
    assert rows(place("uniform", 99, (2, 3))) == ["xxx", "xxx"]


def test_per_layer_counts_cap_each_layer():
    assert per_layer_counts(10, 4, 8) == [3, 3, 2, 2]
    assert per_layer_counts(100, 4, 8) == [8, 8, 8, 8]


COUNTS = torch.tensor([[5, 0, 9, 1],
                       [7, 7, 2, 0],
                       [0, 3, 3, 8]])


def test_frequency_takes_the_global_top_cells_ties_by_index():
    # 9, 8, 7 (layer 1 expert 0), 7 (layer 1 expert 1), 5 ...
    assert rows(place("frequency", 4, (3, 4), COUNTS)) == ["..x.", "xx..", "...x"]
    assert rows(place("frequency", 6, (3, 4), COUNTS)) == ["x.x.", "xx..", ".x.x"]


def test_frequency_puts_more_experts_on_hot_layers():
    counts = torch.tensor([[100, 90, 80, 70], [1, 2, 3, 4]])
    assert rows(place("frequency", 4, (2, 4), counts)) == ["xxxx", "...."]


def test_frequency_needs_counts_of_the_right_shape():
    with pytest.raises(PlacementError, match="needs expert statistics"):
        place("frequency", 2, (3, 4))
    with pytest.raises(PlacementError, match=r"shape \(3, 4\), the model needs \(2, 4\)"):
        place("frequency", 2, (2, 4), COUNTS)


def test_front_loading_fills_the_first_layers():
    assert rows(place("front-loading", 6, (3, 4))) == ["xxxx", "xx..", "...."]
    assert rows(place("front-loading", 6, (3, 4), COUNTS)) == ["xxxx", "xx..", "...."]
    assert rows(place("front-loading", 5, (3, 4), COUNTS)) == ["xxxx", "x...", "...."]
    assert rows(place("front-loading", 10, (3, 4), COUNTS)) == ["xxxx", "xxxx", ".x.x"]   # 8, then 3 vs 3: lower id


def test_random_is_seeded_and_exact_in_count():
    a, b, c = (place("random", 5, (3, 4), seed=s) for s in (1, 1, 2))
    assert torch.equal(a, b) and int(a.sum()) == 5 and not torch.equal(a, c)
    expected = torch.zeros(12, dtype=torch.bool)
    expected[torch.randperm(12, generator=torch.Generator().manual_seed(1))[:5]] = True
    assert torch.equal(a.flatten(), expected)


def test_unknown_strategy_is_refused():
    with pytest.raises(PlacementError, match="unknown placement 'hot'"):
        place("hot", 1, (1, 1))


def test_rank_by_count_is_stable():
    assert rank_by_count(torch.tensor([3, 5, 3, 5, 0])).tolist() == [1, 3, 0, 2, 4]


@pytest.mark.parametrize("kwargs, cells", [
    (dict(gpu_experts=3), 12),
    (dict(gpu_experts=0), 0),
    (dict(gpu_experts=20), 32),                 # more than there are: all of them
    (dict(ratio=0.25), 8),
    (dict(ratio=0.2), 6),                       # 6.4 -> 6
    (dict(ratio=0.3), 10),                      # 9.6 -> 10
    (dict(ratio=1 / 64), 1),                    # 0.5 -> 1 (half up, not to even)
    (dict(ratio=1.0), 32),
    (dict(), 0),                                # no GPU, nothing asked
])
def test_budget_arithmetic(kwargs, cells):
    assert resolve(4, 8, **kwargs).cells == cells


def test_automatic_budget_fits_free_memory():
    memory = DeviceMemory(free_bytes=10_000, kv_bytes=3_000, activation_bytes=1_000, expert_bytes=1_000)
    budget = resolve(4, 8, memory=memory)
    assert budget.cells == 6 and "auto" in budget.reason
    assert resolve(1, 4, memory=memory).cells == 4
    assert resolve(4, 8, memory=DeviceMemory(1_000, 3_000, 0, 10)).cells == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpu_experts=2, ratio=0.5), "not both"),
    (dict(gpu_experts=-1), "--gpu-experts must be an integer >= 0"),
    (dict(ratio=1.5), "--gpu-experts-ratio must be a number in 0..1"),
])
def test_bad_budgets_are_refused(kwargs, message):
    with pytest.raises(PlacementError, match=message):
        resolve(4, 8, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="hot"), "unknown placement 'hot'"),
    (dict(strategy="frequency"), "frequency placement needs expert statistics"),
    (dict(gpu_experts=1, gpu_experts_ratio=0.1), "not both"),
    (dict(gpu_experts=True), "--gpu-experts must be an integer"),
    (dict(gpu_experts_ratio=-0.1), "--gpu-experts-ratio must be a number in 0..1"),
    (dict(prefill_replace_tokens=0), "prefill re-placement threshold"),
    (dict(decode_replace_tokens=0), "decode re-placement interval"),
])
def test_bad_placement_options_are_refused(kwargs, message):
    with pytest.raises(KtError, match=message):
        PlacementOptions(**kwargs)
