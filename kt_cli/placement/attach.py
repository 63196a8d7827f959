"""attach(): the one call the LLM facade makes after building a model and sizing its KV cache."""

import logging
from pathlib import Path

import torch

from .budget import DeviceMemory, activation_bytes
from .options import PlacementOptions
from .runtime import PlacementRuntime

log = logging.getLogger("kt.placement")


def model_id(model: torch.nn.Module, checkpoint=None) -> str:
    """Names the model expert statistics belong to: architecture and checkpoint file/directory name."""
    config = getattr(model, "config", None)
    architecture = getattr(config, "architecture", type(model).__name__)
    path = getattr(checkpoint, "path", None)
    return f"{architecture}:{Path(path).name}" if path is not None else architecture


def device_memory(model: torch.nn.Module, device: str, kv_bytes: int, step_tokens: int) -> DeviceMemory | None:
    """Free memory on a CUDA device for the automatic budget; None on the CPU."""
    config = getattr(model, "config", None)
    if not device.startswith("cuda") or getattr(config, "moe", None) is None:
        return None
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    dtype_bytes = torch.finfo(model.options.dtype).bits // 8
    expert = 3 * config.hidden_size * config.moe.intermediate_size * dtype_bytes
    return DeviceMemory(free, kv_bytes, activation_bytes(step_tokens, config.hidden_size), expert)


def attach(model: torch.nn.Module, options: PlacementOptions, device: str, kv_bytes: int,
           step_tokens: int, checkpoint=None) -> PlacementRuntime:
    runtime = PlacementRuntime(model, model_id(model, checkpoint))
    auto = options.gpu_experts is None and options.gpu_experts_ratio is None
    memory = device_memory(model, device, kv_bytes, step_tokens) if auto and runtime.blocks else None
    runtime.configure(options, memory)
    if runtime.blocks:
        log.info("experts: %s", runtime.stats().summary())
    return runtime
