"""MoE routers: token hidden states -> (weights [T, K] f32, expert ids [T, K] int64, or
int32 from softmax top-k routing on the CPU). Router logits are always computed in float32."""

from dataclasses import dataclass

import torch

from kt_weights.layout import Format, QMatrix

from .. import ops
from ..errors import ModelError
from .linear import GEMM_MIN_TOKENS


class RouterLogits:
    """x [T, H] -> router logits [T, E] in float32. Decode-sized inputs on the CPU run on kt's
    float32 kernel (both threads; 86-93 vs 127-159 us for one token, 128 experts x 2048, weights
    not in cache), larger ones and other devices through torch.mm, which is x @ weight.T bit for
    bit with less dispatch than F.linear. The two sum in different orders (last-bit
    differences; transformers' own router is a bf16 or fp32 F.linear)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.float().contiguous()
        self.kernel = None
        if self.weight.device.type == "cpu":
            self.kernel = ops.BoundLinear(ops.pool(), QMatrix(Format.F32, *self.weight.shape, self.weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype == torch.float32 else x.float()
        if self.kernel is not None and x.shape[0] < GEMM_MIN_TOKENS and x.device.type == "cpu":
            return self.kernel(x.contiguous(), "f32")
        return torch.mm(x, self.weight.t())


class SoftmaxTopK(torch.nn.Module):
    """Mixtral / Qwen-MoE: softmax over all experts, top-k, optionally renormalised. On the
    CPU one native call (ops.softmax_topk, int32 ids), which can also count the choices
    (count_into); elsewhere torch."""

    def __init__(self, weight: torch.Tensor, top_k: int, normalize: bool):
        super().__init__()
        self.logits, self.top_k, self.normalize = RouterLogits(weight), top_k, normalize
        self.counts: torch.Tensor | None = None

    def count_into(self, counts: torch.Tensor) -> bool:
        """From now on add every choice to counts [E] int64 (an ExpertUsage.routed), where
        routing runs natively (the CPU); -> whether it will."""
        if self.logits.weight.device.type != "cpu":
            return False
        self.counts = counts
        return True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(x)
        if logits.device.type == "cpu":
            return ops.softmax_topk(logits, self.top_k, self.normalize, self.counts)
        weights, ids = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


@dataclass(frozen=True)
class GroupLimit:
    """Experts split into n_group equal groups; only the best topk_group groups compete."""
    n_group: int
    topk_group: int

    def validate(self, num_experts: int) -> None:
        if self.n_group < 1 or num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ModelError(f"bad expert groups: {num_experts} experts, n_group={self.n_group}, "
                             f"topk_group={self.topk_group}")

    def group_mask(self, group_scores: torch.Tensor, num_experts: int) -> torch.Tensor:
        """group_scores [T, G] -> bool [T, E], True for experts of the chosen groups"""
        chosen = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        return mask.repeat_interleave(num_experts // self.n_group, dim=1)


class DeepseekV2Router(torch.nn.Module):
    """Softmax scores; 'greedy' top-k or 'group_limited_greedy' (groups ranked by their best expert)."""

    def __init__(self, weight: torch.Tensor, top_k: int, groups: GroupLimit | None, scaling: float):
        super().__init__()
        self.logits, self.top_k, self.groups, self.scaling = RouterLogits(weight), top_k, groups, scaling
        if groups:
            groups.validate(weight.shape[0])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.logits(x).softmax(dim=-1)
        if self.groups:
            num_experts = scores.shape[-1]
            group_best = scores.view(scores.shape[0], self.groups.n_group, -1).amax(dim=-1)
            scores = scores.masked_fill(~self.groups.group_mask(group_best, num_experts), 0.0)
        weights, ids = scores.topk(self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, ids


class DeepseekV3Router(torch.nn.Module):
    """Sigmoid scores; choice by score + e_score_correction_bias within the best groups
    (groups ranked by the sum of their two best biased scores); weights are the
    unbiased scores, optionally renormalised, times routed_scaling_factor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int, groups: GroupLimit,
                 normalize: bool, scaling: float):
        super().__init__()
        self.logits, self.bias = RouterLogits(weight), bias.float()
        self.top_k, self.groups, self.normalize, self.scaling = top_k, groups, normalize, scaling
        groups.validate(weight.shape[0])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.logits(x).sigmoid()
        biased = scores + self.bias
        num_experts = scores.shape[-1]
        per_group = biased.view(scores.shape[0], self.groups.n_group, -1)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
        biased = biased.masked_fill(~self.groups.group_mask(group_scores, num_experts), float("-inf"))
        ids = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids
