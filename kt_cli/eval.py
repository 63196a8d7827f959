"""Perplexity the way llama.cpp's llama-perplexity measures it, so the figures compare.

The whole text is tokenized once (BOS only if the tokenizer adds one, and then it replaces
the first token of every chunk, as llama.cpp does). It is cut into n_tokens // ctx chunks
of ctx tokens, each evaluated on its own from an empty cache. In each chunk only the second
half is scored: the logits at positions ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1,
so each chunk scores ctx - ctx/2 - 1 tokens, each with a context of at least ctx/2 tokens.
"""

import math
from dataclasses import asdict, dataclass

import torch

from .errors import KtError

CHUNKS_PER_CALL = 2


@dataclass(frozen=True)
class EvalResult:
    ppl: float
    ppl_stderr: float
    n_tokens: int
    n_ctx: int
    n_chunks: int
    n_scored: int
    running_ppl: tuple[float, ...]

    def to_dict(self) -> dict:
        return asdict(self) | {"running_ppl": list(self.running_ppl)}


def perplexity(llm, text: str, ctx: int = 512, max_chunks: int | None = None) -> EvalResult:
    """max_chunks: score only the first chunks (llama-perplexity --chunks)."""
    if ctx < 4 or ctx % 2:
        raise KtError(f"perplexity context must be an even number >= 4, got {ctx}")
    if ctx > llm.ctx:
        raise KtError(f"perplexity context {ctx} exceeds the model's loaded context {llm.ctx}")
    tokens = _tokenize(llm.tokenizer, text)
    n_chunks = len(tokens) // ctx if max_chunks is None else min(len(tokens) // ctx, max_chunks)
    if n_chunks == 0:
        raise KtError(f"the text has {len(tokens)} tokens, fewer than one {ctx}-token chunk")
    chunks = [_chunk(llm.tokenizer, tokens, i, ctx) for i in range(n_chunks)]
    nll = []
    running = []
    for start in range(0, n_chunks, CHUNKS_PER_CALL):
        batch = chunks[start:start + CHUNKS_PER_CALL]
        for chunk, logits in zip(batch, llm.logits(batch, start=ctx // 2)):
            nll.append(second_half_nll(logits, chunk))
            running.append(math.exp(torch.cat(nll).mean().item()))
    return _result(torch.cat(nll).double(), len(tokens), ctx, running)


def second_half_nll(logits: torch.Tensor, chunk: list[int]) -> torch.Tensor:
    """logits [ctx - ctx/2, vocab] at positions ctx/2 .. ctx-1 of one chunk -> negative
    log-likelihoods [ctx - ctx/2 - 1] of tokens ctx/2+1 .. ctx-1."""
    first = len(chunk) // 2
    log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = torch.tensor(chunk[first + 1:], dtype=torch.int64)
    return -log_probs.gather(1, targets[:, None])[:, 0]


def _tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _chunk(tokenizer, tokens: list[int], index: int, ctx: int) -> list[int]:
    chunk = tokens[index * ctx:(index + 1) * ctx]
    if getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_token_id is not None:
        chunk[0] = tokenizer.bos_token_id
    return chunk


def _result(nll: torch.Tensor, n_tokens: int, ctx: int, running: list[float]) -> EvalResult:
    """stderr of ppl by the delta method: ppl * std(nll) / sqrt(n), as llama.cpp reports it."""
    mean = nll.mean().item()
    stderr = math.exp(mean) * (nll.std(unbiased=True).item() / math.sqrt(len(nll)))
    return EvalResult(ppl=math.exp(mean), ppl_stderr=stderr, n_tokens=n_tokens, n_ctx=ctx,
                      n_chunks=len(running), n_scored=len(nll), running_ppl=tuple(running))
