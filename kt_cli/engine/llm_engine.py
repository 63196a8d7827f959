"""The engine: requests in, token and text deltas out, one step at a time.

The flow of one step, and what each hop hands to the next:

  add_request(prompt ids, SamplingParams)  -> Sequence          (inbox, any thread)
  Scheduler.schedule()                     -> list[ScheduledChunk] (who runs, how many tokens;
                                              BlockManager gives each chunk its KV blocks)
  ModelRunner.build_batch(chunks)          -> ForwardBatch      (flat ids, positions, slots)
  model.forward(ForwardBatch)              -> logits [R, vocab] (one row per sampling chunk)
  Sampler(logits, sequences)               -> list[int]         (next token per sampling chunk)
    or, when every sampling row is greedy without penalties (Sampler.argmax_only):
  model.greedy_tokens(ForwardBatch)        -> [R] int64         (the argmax, no logits handed on)
  LLMEngine._advance(seq, token)           -> RequestOutput     (stop checks, TextStream delta)

add_request and abort may be called from other threads (the HTTP server's): they only
touch a locked inbox, which step() drains. step() itself runs on one thread.
"""

import threading
import uuid
from dataclasses import dataclass, field

import torch

from ..errors import KtError
from ..layers.sampler import Sampler
from .block_manager import BlockManager, EvictionListener
from .detokenizer import Decoder, TextStream
from .model_runner import CausalLM, ModelRunner, blocks_in_budget
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from .sequence import Sequence


class PromptError(KtError):
    pass


@dataclass(frozen=True)
class EngineConfig:
    ctx: int
    kv_bytes: int
    block_size: int = 16
    max_batch: int = 8
    max_step_tokens: int = 512
    prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    prefill_torch_threads: int | None = None    # torch threads for steps of many tokens (ModelRunner)

    def __post_init__(self):
        for name in ("ctx", "kv_bytes", "block_size", "max_batch", "max_step_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KtError(f"{name} must be an integer >= 1, got {value!r}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))


@dataclass
class RequestOutput:
    """What changed for one request in one step."""
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int


@dataclass
class _Inbox:
    lock: threading.Lock = field(default_factory=threading.Lock)
    new: list[Sequence] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    known: set[str] = field(default_factory=set)


class LLMEngine:
    def __init__(self, model: CausalLM, tokenizer: Decoder, config: EngineConfig,
                 device: torch.device | str = "cpu", eviction_listener: EvictionListener | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = _vocab_size(model)
        num_blocks = blocks_in_budget(model.kv_specs(), config.block_size, config.kv_bytes)
        _check_pool(num_blocks, config)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.prefix_caching,
                                          eviction_listener)
        self.scheduler = Scheduler(SchedulerConfig(config.max_batch, config.max_step_tokens),
                                   self.block_manager)
        generator = None if config.seed is None else torch.Generator().manual_seed(config.seed)
        self.runner = ModelRunner(model, config.block_size, num_blocks, Sampler(generator), device,
                                  config.prefill_torch_threads)
        self.streams: dict[str, TextStream] = {}
        self.inbox = _Inbox()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        self.check_prompt(prompt_token_ids)
        request_id = request_id or uuid.uuid4().hex
        seq = Sequence(request_id, prompt_token_ids, params, self.config.block_size)
        with self.inbox.lock:
            if request_id in self.inbox.known:
                raise KtError(f"request id {request_id!r} is already in use")
            self.inbox.known.add(request_id)
            self.inbox.new.append(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed and its final output reported at the next step."""
        with self.inbox.lock:
            self.inbox.aborts.append(request_id)

    def has_unfinished(self) -> bool:
        with self.inbox.lock:
            return bool(self.inbox.new or self.inbox.aborts) or self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        chunks = self.scheduler.schedule()
        if not chunks:
            return outputs
        tokens = self.runner.run(chunks)
        self.scheduler.on_computed(chunks)
        sampled = [chunk.seq for chunk in chunks if chunk.samples]
        outputs.extend(self._advance(seq, token) for seq, token in zip(sampled, tokens))
        return outputs

    def check_prompt(self, token_ids: list[int]) -> None:
        if len(token_ids) == 0:
            raise PromptError("prompt is empty")
        if len(token_ids) > self.config.ctx:
            raise PromptError(f"prompt has {len(token_ids)} tokens, context limit is {self.config.ctx}")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"prompt token id {bad[0]!r} is outside the vocabulary (0..{self.vocab_size - 1})")

    def score(self, token_lists: list[list[int]], start: int = 0) -> list[torch.Tensor]:
        """Teacher-forced logits at positions start.. of each list: [len - start, vocab] each.
        Runs on the calling thread and needs an idle engine."""
        if self.has_unfinished():
            raise KtError("score() needs an engine with no requests in flight")
        for token_ids in token_lists:
            self.check_prompt(token_ids)
            if not 0 <= start < len(token_ids):
                raise KtError(f"score start {start} is outside a {len(token_ids)}-token list")
        return [self._score_one(token_ids, start) for token_ids in token_lists]

    def _score_one(self, token_ids: list[int], start: int) -> torch.Tensor:
        seq = Sequence("score", token_ids, SamplingParams(), self.config.block_size)
        if not self.block_manager.admit(seq, len(seq), reuse_prefix=False):
            raise KtError(f"the KV cache cannot hold {len(seq)} tokens at once")
        rows = []
        try:
            while seq.num_pending:
                chunk = [ScheduledChunk(seq, min(seq.num_pending, self.config.max_step_tokens))]
                rows.append(self.runner.logits(chunk, first=max(start - seq.num_computed, 0)))
                self.scheduler.on_computed(chunk)
        finally:
            self.block_manager.free(seq)
        return torch.cat([r for r in rows if len(r)])

    def _drain_inbox(self) -> list[RequestOutput]:
        with self.inbox.lock:
            new, self.inbox.new = self.inbox.new, []
            aborts, self.inbox.aborts = self.inbox.aborts, []
        for seq in new:
            self.streams[seq.request_id] = TextStream(self.tokenizer, seq.token_ids, seq.params.stop,
                                                      seq.params.skip_special_tokens)
            self.scheduler.add(seq)
        return [out for out in (self._abort_now(request_id) for request_id in aborts) if out]

    def _abort_now(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self._output(seq, [])

    def _advance(self, seq: Sequence, token: int) -> RequestOutput:
        seq.append_token(token)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._output(seq, [token])

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if (token in self.config.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if self.streams[seq.request_id].push(token):
            return "stop"
        if seq.num_generated >= params.max_tokens or len(seq) >= self.config.ctx:
            return "length"
        return None

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        stream = self.streams[seq.request_id]
        delta = stream.delta(final=seq.is_finished)
        if seq.is_finished:
            self._forget(seq.request_id)
        return RequestOutput(seq.request_id, new_tokens, delta, seq.is_finished, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_generated)

    def _forget(self, request_id: str) -> None:
        del self.streams[request_id]
        with self.inbox.lock:
            self.inbox.known.discard(request_id)


def _vocab_size(model: CausalLM) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if size is None and isinstance(config, dict):
        size = config.get("vocab_size")
    return int(size) if size else 2**62


def _check_pool(num_blocks: int, config: EngineConfig) -> None:
    needed = -(-config.ctx // config.block_size)
    if num_blocks < needed:
        raise KtError(f"the KV budget ({config.kv_bytes / 2**20:.1f} MiB) holds {num_blocks} blocks of "
                      f"{config.block_size} tokens, fewer than one {config.ctx}-token context needs "
                      f"({needed}); raise the KV budget or lower ctx")
