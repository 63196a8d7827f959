"""A sparse MoE block: router -> routed experts on the CPU through kt's fused
operator (asynchronous), while the shared expert and any device-resident experts
run in torch; then the results are summed.

Expert placement: experts whose `on_device` flag is set are computed in torch on
the model's device; their ids are masked to -1 for the CPU operator, which skips them."""

import torch

from kt_weights.layout import QMatrix

from ..errors import ModelError
from ..ops.moe import MoEExperts
from .linear import Linear, Target
from .mlp import GatedMLP, activation

ExpertWeights = tuple[list[QMatrix], list[QMatrix], list[QMatrix]]   # gate, up, down per expert


def cpu_experts(weights: ExpertWeights, act: str):
    return MoEExperts(*weights, activation=act)


class DeviceExperts(torch.nn.Module):
    """The experts flagged in `on_device`, dequantized into the compute dtype."""

    def __init__(self, weights: ExpertWeights, on_device: torch.Tensor, target: Target, act: str):
        super().__init__()
        self.act = activation(act)
        self.index = {int(e): i for i, e in enumerate(on_device.nonzero().flatten())}
        self.gate, self.up, self.down = ([target.put(m[e].dequantize()) for e in self.index] for m in weights)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids/weights [T, K] on x's device -> [T, H]"""
        out = torch.zeros_like(x)
        for e, i in self.index.items():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            h = self.act(xe @ self.gate[i].T) * (xe @ self.up[i].T)
            out.index_add_(0, tok, (h @ self.down[i].T) * weights[tok, slot, None].to(x.dtype))
        return out


class SharedExpert(torch.nn.Module):
    """Always-on expert(s); Qwen2-MoE scales it by sigmoid(gate(x))."""

    def __init__(self, mlp: GatedMLP, gate: Linear | None = None):
        super().__init__()
        self.mlp, self.gate = mlp, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y


class MoEBlock(torch.nn.Module):
    def __init__(self, router: torch.nn.Module, experts: ExpertWeights, target: Target,
                 shared: SharedExpert | None = None, on_device: list[bool] | None = None, act: str = "silu"):
        super().__init__()
        self.router, self.shared = router, shared
        self.num_experts = len(experts[0])
        self.cpu = cpu_experts(experts, act)
        mask = _placement_mask(on_device, self.num_experts)
        self.on_device = mask if mask.any() else None
        self.device_experts = DeviceExperts(experts, mask, target, act) if mask.any() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]"""
        weights, ids = self.router(x)                       # [T, K] f32, [T, K] int64
        job = self.cpu.submit(x.to(torch.float32).cpu().contiguous(), self._cpu_ids(ids),
                              weights.cpu().contiguous())
        out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        if self.device_experts is not None:
            out = out + self.device_experts(x, ids, weights)
        return out + job.wait().to(device=x.device, dtype=x.dtype)

    def _cpu_ids(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.cpu()
        if self.on_device is not None:
            ids = ids.masked_fill(self.on_device[ids], -1)
        return ids.to(torch.int32).contiguous()


def _placement_mask(on_device: list[bool] | None, num_experts: int) -> torch.Tensor:
    if on_device is None:
        return torch.zeros(num_experts, dtype=torch.bool)
    if len(on_device) != num_experts:
        raise ModelError(f"expert placement mask has {len(on_device)} entries for {num_experts} experts")
    return torch.tensor([bool(b) for b in on_device], dtype=torch.bool)
