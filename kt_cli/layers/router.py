"""MoE routers: token hidden states -> (weights [T, K] f32, expert ids [T, K] int64).
Router logits are always computed in float32."""

from dataclasses import dataclass

import torch

from ..errors import ModelError


def _logits(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, E]; torch.mm is x @ weight.T bit for bit, with less dispatch (26 vs 41 us
    for one token, 128 experts x 2048)"""
    return torch.mm(x if x.dtype == torch.float32 else x.float(), weight.t())


class SoftmaxTopK(torch.nn.Module):
    """Mixtral / Qwen-MoE: softmax over all experts, top-k, optionally renormalised."""

    def __init__(self, weight: torch.Tensor, top_k: int, normalize: bool):
        super().__init__()
        self.weight, self.top_k, self.normalize = weight.float(), top_k, normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = _logits(self.weight, x).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
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
        self.weight, self.top_k, self.groups, self.scaling = weight.float(), top_k, groups, scaling
        if groups:
            groups.validate(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = _logits(self.weight, x).softmax(dim=-1)
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
        self.weight, self.bias = weight.float(), bias.float()
        self.top_k, self.groups, self.normalize, self.scaling = top_k, groups, normalize, scaling
        groups.validate(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = _logits(self.weight, x).sigmoid()
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
