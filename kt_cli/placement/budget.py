"""How many (layer, expert) cells go to the device: --gpu-experts N per MoE layer,
--gpu-experts-ratio R of all routed experts, or automatic (what free device memory holds)."""

import math
from dataclasses import dataclass

from .errors import PlacementError

GIB = 2**30
ACTIVATION_RESERVE_BYTES = GIB          # allocator slack, CUDA context growth, router/attention scratch
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 32  # bytes per (step token x hidden unit) kept for activations


@dataclass(frozen=True)
class Budget:
    cells: int          # (layer, expert) cells on the device
    reason: str         # how the figure was chosen, for the startup log


@dataclass(frozen=True)
class DeviceMemory:
    """What the automatic budget sees: free bytes on the device after the model's other
    weights, minus what the KV cache and activations will take, and one expert's size there."""
    free_bytes: int
    kv_bytes: int
    activation_bytes: int
    expert_bytes: int

    def cells(self) -> int:
        room = self.free_bytes - self.kv_bytes - self.activation_bytes
        return max(0, room // self.expert_bytes) if self.expert_bytes > 0 else 0


def resolve(num_layers: int, num_experts: int, gpu_experts: int | None = None,
            ratio: float | None = None, memory: DeviceMemory | None = None) -> Budget:
    """memory None and no explicit figure: no device (0 cells)."""
    total = num_layers * num_experts
    if gpu_experts is not None and ratio is not None:
        raise PlacementError("give --gpu-experts or --gpu-experts-ratio, not both")
    if gpu_experts is not None:
        return _per_layer(gpu_experts, num_layers, num_experts)
    if ratio is not None:
        return _ratio(ratio, total)
    if memory is None:
        return Budget(0, "no GPU: every routed expert stays in RAM")
    cells = min(memory.cells(), total)
    return Budget(cells, f"auto: {memory.free_bytes / GIB:.2f} GiB free, {memory.kv_bytes / GIB:.2f} GiB KV, "
                         f"{memory.activation_bytes / GIB:.2f} GiB activations, "
                         f"{memory.expert_bytes / 2**20:.1f} MiB per expert -> {cells} of {total}")


def _per_layer(n: int, num_layers: int, num_experts: int) -> Budget:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise PlacementError(f"--gpu-experts must be an integer >= 0, got {n!r}")
    if n > num_experts:
        return Budget(num_layers * num_experts, f"{n} per MoE layer asked, capped at all {num_experts}")
    return Budget(n * num_layers, f"{n} per MoE layer (--gpu-experts)")


def _ratio(ratio: float, total: int) -> Budget:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise PlacementError(f"--gpu-experts-ratio must be a number in 0..1, got {ratio!r}")
    cells = min(total, math.floor(ratio * total + 0.5))
    return Budget(cells, f"{ratio:g} of {total} routed experts (--gpu-experts-ratio) -> {cells}")


def activation_bytes(step_tokens: int, hidden: int) -> int:
    return ACTIVATION_RESERVE_BYTES + ACTIVATION_BYTES_PER_TOKEN_HIDDEN * step_tokens * hidden
