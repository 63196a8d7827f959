"""The offline Python API: `LLM(model, **options)`, then generate / chat / logits.

    llm = LLM("SmolLM2-135M-Instruct.Q4_1.gguf", ctx=2048)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].text)
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from . import hardware
from .engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from .engine.model_runner import kv_bytes_per_token
from .engine.sampling_params import SamplingParams
from .errors import KtError
from .ops import hugepages

__all__ = ["LLM", "LLMOptions", "Output", "SamplingParams"]

DEFAULT_CTX_CAP = 4096
DEFAULT_KV_RAM_SHARE = 0.2


@dataclass(frozen=True)
class LLMOptions:
    """ctx: context length (default: the model's, capped at 4096). kv_memory_gb: KV cache
    budget (default: room for max_batch full contexts, at most a fifth of free RAM).
    threads: kt's kernel pool (default KT_THREADS, else the physical cores). torch_threads:
    torch's intra-op threads for the small ops around the kernels (default 1 on the CPU:
    measured on 2 busy cores, 2 torch threads made decode ~8x slower than 1).
    gpu_experts .. decode_replace_tokens: routed-expert placement (kt_cli.placement.PlacementOptions:
    gpu_experts per MoE layer or gpu_experts_ratio of all, default automatic on a GPU and 0
    without; placement uniform|frequency|front-loading|random; expert_stats FILE for frequency;
    record_expert_stats FILE; dynamic re-placement thresholds)."""
    device: str = "cpu"
    dtype: torch.dtype | None = None
    threads: int | None = None
    torch_threads: int | None = None
    max_batch: int = 8
    ctx: int | None = None
    kv_memory_gb: float | None = None
    block_size: int = 16
    max_step_tokens: int = 512
    prefix_caching: bool = True
    seed: int | None = None
    gpu_experts: int | None = None
    gpu_experts_ratio: float | None = None
    placement: str = "uniform"
    expert_stats: str | Path | None = None
    placement_seed: int = 0
    record_expert_stats: str | Path | None = None
    prefill_replace_tokens: int | None = None
    decode_replace_tokens: int | None = None

    def __post_init__(self):
        self.placement_options()
        for name in ("threads", "torch_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise KtError(f"{name} must be an integer >= 1, got {value!r}")
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise KtError(f"kv_memory_gb must be > 0, got {self.kv_memory_gb!r}")
        if self.ctx is not None and (not isinstance(self.ctx, int) or self.ctx < 2):
            raise KtError(f"ctx must be an integer >= 2, got {self.ctx!r}")

    def placement_options(self):
        from .placement import PlacementOptions
        return PlacementOptions(self.gpu_experts, self.gpu_experts_ratio, self.placement, self.expert_stats,
                                self.placement_seed, self.record_expert_stats,
                                prefill_replace_tokens=self.prefill_replace_tokens,
                                decode_replace_tokens=self.decode_replace_tokens)

    @classmethod
    def from_kwargs(cls, options: dict) -> "LLMOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise KtError(f"unknown LLM option {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**options)


@dataclass
class Output:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class LLM:
    def __init__(self, model: str | Path, **options):
        from kt_weights.checkpoint import open_checkpoint

        from .models.registry import ModelOptions, build_model

        opts = LLMOptions.from_kwargs(options)
        _set_threads(opts)
        self.checkpoint = open_checkpoint(model)
        built = build_model(self.checkpoint, ModelOptions(device=opts.device, dtype=opts.dtype))
        hardware.release_freed_memory()
        # the trim splits the huge pages freed temporaries shared with the weights (ops.hugepages)
        hugepages.collapse(built.streamed_weights())
        hardware.hold_step_buffers()
        self._start(built, self.checkpoint.tokenizer(), opts)

    @classmethod
    def from_model(cls, model, tokenizer, **options) -> "LLM":
        """An LLM over a model object already built (tests, embedding in other programs)."""
        opts = LLMOptions.from_kwargs(options)
        _set_threads(opts)
        llm = cls.__new__(cls)
        llm.checkpoint = None
        llm._start(model, tokenizer, opts)
        return llm

    def _start(self, model, tokenizer, opts: LLMOptions) -> None:
        from .placement.attach import attach

        self.model, self.tokenizer, self.options = model, tokenizer, opts
        ctx = opts.ctx or min(_model_max_positions(model) or DEFAULT_CTX_CAP, DEFAULT_CTX_CAP)
        kv_bytes = _kv_budget(model, opts, ctx)
        self.placement = attach(model, opts.placement_options(), opts.device, kv_bytes, opts.max_step_tokens,
                                self.checkpoint)
        config = EngineConfig(
            ctx=ctx, kv_bytes=kv_bytes, block_size=opts.block_size,
            max_batch=opts.max_batch, max_step_tokens=opts.max_step_tokens,
            prefix_caching=opts.prefix_caching, eos_token_ids=eos_token_ids(model, tokenizer), seed=opts.seed,
            prefill_torch_threads=_prefill_torch_threads(opts))
        self.engine = LLMEngine(model, tokenizer, config, device=opts.device)

    @property
    def ctx(self) -> int:
        return self.engine.config.ctx

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Output]:
        prompt_ids = [p if isinstance(p, list) else self.encode(p) for p in prompts]
        per_prompt = params if isinstance(params, list) else [params or SamplingParams()] * len(prompt_ids)
        if len(per_prompt) != len(prompt_ids):
            raise KtError(f"{len(prompt_ids)} prompts but {len(per_prompt)} sampling parameter sets")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompt_ids, per_prompt)]
        collected = self._run(set(ids))
        return [_output(request_id, prompt, collected[request_id])
                for request_id, prompt in zip(ids, prompt_ids)]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Output:
        return self.generate([self.chat_prompt(messages)], params)[0]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        prompt_ids = prompt if isinstance(prompt, list) else self.encode(prompt)
        request_id = self.engine.add_request(prompt_ids, params)
        try:
            finished = False
            while not finished:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self._abort({request_id})

    def stats(self):
        """Routed-expert placement: per-layer device/CPU split, hit rate, time split
        (kt_cli.placement.PlacementStats; .to_dict() for JSON)."""
        return self.placement.stats()

    def save_expert_stats(self, path: str | Path) -> Path:
        """Routed tokens per (MoE layer, expert) so far, for --placement frequency."""
        return self.placement.save_expert_stats(path)

    def logits(self, token_lists: list[list[int]], start: int = 0) -> list[torch.Tensor]:
        """Teacher-forced logits at positions start.. of each list: [len - start, vocab] float32."""
        return self.engine.score(token_lists, start)

    def _run(self, wanted: set[str]) -> dict[str, list[RequestOutput]]:
        collected: dict[str, list[RequestOutput]] = {request_id: [] for request_id in wanted}
        pending = set(wanted)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in collected:
                        collected[out.request_id].append(out)
                        if out.finished:
                            pending.discard(out.request_id)
        except BaseException:
            self._abort(pending)
            raise
        return collected

    def _abort(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)
        self.engine.step()


def _output(request_id: str, prompt: list[int], deltas: list[RequestOutput]) -> Output:
    return Output(request_id=request_id, prompt_token_ids=list(prompt),
                  token_ids=[t for d in deltas for t in d.new_token_ids],
                  text="".join(d.text_delta for d in deltas), finish_reason=deltas[-1].finish_reason,
                  num_cached_tokens=deltas[-1].num_cached_tokens)


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS plus every EOS id the model config lists."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    extra = getattr(getattr(model, "config", None), "extra", None) or {}
    configured = extra.get("eos_token_id")
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, (list, tuple)):
        ids.update(int(i) for i in configured)
    return tuple(sorted(ids))


def _model_max_positions(model) -> int | None:
    extra = getattr(getattr(model, "config", None), "extra", None) or {}
    value = extra.get("max_position_embeddings")
    return int(value) if value else None


def _kv_budget(model, opts: LLMOptions, ctx: int) -> int:
    if opts.kv_memory_gb is not None:
        return int(opts.kv_memory_gb * 2**30)
    per_token = kv_bytes_per_token(model.kv_specs())
    wanted = opts.max_batch * ctx * per_token
    ram_share = int(hardware.memory().available_bytes * DEFAULT_KV_RAM_SHARE)
    return max(min(wanted, ram_share), (ctx + opts.block_size) * per_token)


def _prefill_torch_threads(opts: LLMOptions) -> int | None:
    """On the CPU, unless torch_threads was set: the kt pool's thread count for big prefill
    steps (kt_cli.engine.model_runner.ModelRunner)."""
    if opts.device != "cpu" or opts.torch_threads is not None:
        return None
    return opts.threads or hardware.default_threads()


def _set_threads(opts: LLMOptions) -> None:
    torch_threads = opts.torch_threads or (1 if opts.device == "cpu" else None)
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    if opts.threads is not None:
        os.environ["KT_THREADS"] = str(opts.threads)   # read once when kt's native thread pool starts
