"""Turns checkpoint tensors (HF names) into kt layers placed per ModelOptions."""

import torch

from kt_weights.layout import QMatrix

from ..errors import ModelError
from ..layers.fused import FusedLinear
from ..layers.linear import Linear, Target
from ..layers.mlp import GatedMLP
from ..layers.moe import ExpertWeights
from ..layers.norm import RMSNorm

EXPERT_PROJS = ("gate", "up", "down")


class Weights:
    def __init__(self, ckpt, target: Target, architecture: str):
        self.ckpt, self.target, self.architecture = ckpt, target, architecture

    def has(self, name: str) -> bool:
        return self.ckpt.has(name)

    def _require(self, name: str) -> None:
        if not self.ckpt.has(name):
            raise ModelError(f"checkpoint lacks tensor {name} needed by {self.architecture}")

    def tensor(self, name: str) -> torch.Tensor:
        """float32, on the CPU"""
        self._require(name)
        return self.ckpt.tensor(name)

    def matrix(self, name: str) -> QMatrix:
        self._require(name)
        return self.ckpt.matrix(name)

    def linear(self, name: str, bias: bool = False) -> Linear:
        b = self.tensor(f"{name}.bias") if bias else None
        return Linear(self.matrix(f"{name}.weight"), b, self.target)

    def fused(self, names: list[str], bias: bool | list[bool] = False) -> FusedLinear:
        """Linears over the same input as one kernel call (kt_cli.layers.fused); bias: for all or per name."""
        flags = bias if isinstance(bias, list) else [bias] * len(names)
        biases = [self.tensor(f"{name}.bias") if b else None for name, b in zip(names, flags, strict=True)]
        return FusedLinear([self.matrix(f"{name}.weight") for name in names], biases, self.target)

    def dense(self, name: str) -> torch.Tensor:
        """A weight as a plain tensor in the compute dtype on the device."""
        return self.target.put(self.tensor(name))

    def exact(self, name: str) -> torch.Tensor:
        """A small weight kept in float32 on the device (router weights and biases)."""
        return self.tensor(name).to(self.target.device)

    def norm(self, name: str, eps: float) -> RMSNorm:
        return RMSNorm(self.dense(f"{name}.weight"), eps)

    def mlp(self, prefix: str, act: str, bias: bool = False) -> GatedMLP:
        gate_up = self.fused([f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias)
        return GatedMLP(gate_up, self.linear(f"{prefix}.down_proj", bias), act)

    def experts(self, layer: int) -> ExpertWeights:
        gate, up, down = (list(self.ckpt.experts(layer, p)) for p in EXPERT_PROJS)
        if not gate or not len(gate) == len(up) == len(down):
            raise ModelError(f"layer {layer}: expert lists have {len(gate)}/{len(up)}/{len(down)} entries")
        return gate, up, down
