"""Next-token choice for a batch of sequences, each with its own sampling parameters.

Order of transforms (vLLM's): penalties on raw logits -> greedy rows take the argmax ->
temperature -> top-k -> top-p -> min-p -> one draw per row from its own generator.
Sampling runs on the CPU whatever the model's device: per-request generators then give the
same tokens on every device, and [B, vocab] is small next to the forward pass.
"""

from typing import Protocol

import torch

from ..engine.sampling_params import SamplingParams

FIRST_CANDIDATES = 1024


class SamplingState(Protocol):
    """What the sampler reads from a sequence (kt_cli.engine.sequence.Sequence fits)."""
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None


class Sampler:
    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    @staticmethod
    def argmax_only(rows: list[SamplingState]) -> bool:
        """Whether these rows' tokens are the argmax of their raw logits (greedy, no penalties)"""
        return bool(rows) and all(row.params.greedy and not row.params.has_penalties for row in rows)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingState]) -> list[int]:
        logits = apply_penalties(logits.float().cpu(), rows)   # [B, V]
        if all(row.params.greedy for row in rows):
            return logits.argmax(dim=-1).tolist()
        chosen = [0] * len(rows)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if greedy:
            for i, token in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
                chosen[i] = token
        if random:
            probs, ids = filtered_candidates(logits[random], [rows[i].params for i in random])
            for i, row_probs, row_ids in zip(random, probs, ids):
                chosen[i] = int(row_ids[self._draw(row_probs, rows[i].generator)])
        return chosen

    def _draw(self, probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """Inverse-CDF draw of one index from probs [K] (sums to 1 up to rounding)."""
        cdf = probs.cumsum(dim=0)
        u = torch.rand((), generator=generator or self.generator) * cdf[-1]
        return min(int(torch.searchsorted(cdf, u, right=True)), len(probs) - 1)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingState]) -> torch.Tensor:
    """Repetition penalty over prompt + generated tokens (divide positive logits, multiply
    negative ones); presence and frequency penalties over generated tokens only:
    logit -= frequency * count + presence * (count > 0)."""
    if not any(row.params.has_penalties for row in rows):
        return logits
    logits = logits.clone()
    for i, row in enumerate(rows):
        params = row.params
        if params.repetition_penalty != 1.0:
            _repetition_penalty(logits[i], row.token_ids, params.repetition_penalty)
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            generated = row.token_ids[row.num_prompt_tokens:]
            counts = torch.bincount(torch.tensor(generated, dtype=torch.int64),
                                    minlength=logits.shape[-1]).to(logits.dtype)
            logits[i] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def _repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    seen = torch.tensor(sorted(set(token_ids)), dtype=torch.int64)
    values = logits[seen]
    logits[seen] = torch.where(values > 0, values / penalty, values * penalty)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[B, V] logits -> [B, V] probabilities after temperature, top-k, top-p and min-p."""
    probs, ids = filtered_candidates(logits, params)
    return torch.zeros_like(logits).scatter_(-1, ids, probs)


def filtered_candidates(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] logits -> (probs [B, K], token ids [B, K]): the filtered distribution over the K
    most likely tokens, K no larger than the filters need (sorting all V is the slow part)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        return torch.softmax(logits, dim=-1), torch.arange(vocab).expand(len(params), vocab)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    log_total = torch.logsumexp(logits, dim=-1)
    for k in _candidate_counts(params, vocab):
        sorted_logits, ids = logits.topk(k, dim=-1)
        if k == vocab or _enough(sorted_logits, log_total, top_k, params):
            return _filter_sorted(sorted_logits, log_total, top_k, params), ids
    raise AssertionError("unreachable: the whole vocabulary is always enough")


def _candidate_counts(params: list[SamplingParams], vocab: int) -> list[int]:
    if all(p.top_k > 0 for p in params):
        return [min(max(p.top_k for p in params), vocab)]
    return [min(FIRST_CANDIDATES, vocab), vocab]


def _enough(sorted_logits, log_total, top_k, params) -> bool:
    """True when every row's filtered set lies inside the candidates: rows limited by
    top_k are; a top_p row needs the candidates' mass to reach top_p; a min_p row needs its
    last candidate already below min_p times the largest probability."""
    k = sorted_logits.shape[-1]
    mass = torch.exp(torch.logsumexp(sorted_logits, dim=-1) - log_total)
    smallest_ratio = torch.exp(sorted_logits[:, -1] - sorted_logits[:, 0])
    for i, p in enumerate(params):
        if top_k[i] <= k:
            continue
        if p.top_p < 1.0 and mass[i] < p.top_p:
            return False
        if p.top_p >= 1.0 and not smallest_ratio[i] < p.min_p:
            return False
    return True


def _filter_sorted(sorted_logits, log_total, top_k, params) -> torch.Tensor:
    """Filters on candidate logits sorted in descending order; returns renormalised probs.
    Probabilities are over top_k survivors when top_k applies, else over the whole vocabulary."""
    k = sorted_logits.shape[-1]
    rank = torch.arange(k)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    log_norm = torch.where(top_k <= k, torch.logsumexp(sorted_logits, dim=-1), log_total)
    probs = torch.exp(sorted_logits - log_norm[:, None])
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], dtype=probs.dtype)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
