"""Backend over an in-process LLMEngine: step() until the request finishes, text deltas out."""

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from ..errors import KtError
from .backend import BackendError, Chunk, ContextOverflow, ReplyEnd, Sampling


class LocalBackend:
    def __init__(self, model: str | Path, threads: int | None = None, ctx: int | None = None):
        self.llm = _load(model, threads, ctx)
        self.model_name = _display_name(model)
        self.where = "in-process"
        self.ctx = self.llm.ctx
        if not getattr(self.llm.tokenizer, "chat_template", None):
            raise BackendError(f"{self.model_name} has no chat template (a base model?); "
                               f"kt chat needs an instruct or chat model")

    def stream(self, messages: list[dict], sampling: Sampling, cancel: threading.Event) -> Iterator[Chunk]:
        prompt = self._prompt_ids(messages)
        room = self.ctx - len(prompt)
        if room < 1:
            raise ContextOverflow(f"the conversation is {len(prompt)} tokens; the context holds {self.ctx}")
        engine = self.llm.engine
        try:
            request_id = engine.add_request(prompt, self._params(sampling, room))
        except KtError as err:
            raise BackendError(str(err)) from None
        finished = False
        try:
            while not finished:
                if cancel.is_set():
                    engine.abort(request_id)
                for out in engine.step():
                    if out.request_id != request_id:
                        continue
                    finished = out.finished
                    yield self._chunk(out, room)
        finally:
            if not finished:
                self._drop(request_id)

    def close(self) -> None:
        checkpoint = getattr(self.llm, "checkpoint", None)
        if checkpoint is not None:
            checkpoint.close()

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        try:
            return self.llm.chat_prompt(messages)
        except Exception as err:  # jinja2 / transformers raise their own types for template problems
            raise BackendError(f"the chat template of {self.model_name} rejects this conversation: "
                               f"{_first_line(err)}") from None

    def _params(self, sampling: Sampling, room: int):
        from ..engine.sampling_params import SamplingParams

        max_tokens = min(sampling.max_tokens or room, room)
        return SamplingParams(max_tokens=max_tokens, temperature=float(sampling.temperature),
                              top_p=float(sampling.top_p), seed=sampling.seed)

    @staticmethod
    def _chunk(out, room: int) -> Chunk:
        if not out.finished:
            return Chunk(out.text_delta)
        end = ReplyEnd(out.finish_reason, out.num_prompt_tokens, out.num_generated_tokens,
                       context_full=out.finish_reason == "length" and out.num_generated_tokens >= room)
        return Chunk(out.text_delta, end)

    def _drop(self, request_id: str) -> None:
        """The stream was closed early: let the engine free the request before the next one."""
        engine = self.llm.engine
        engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()


def _load(model: str | Path, threads: int | None, ctx: int | None):
    from kt_weights.errors import WeightsError

    from ..llm import LLM

    try:
        with contextlib.redirect_stdout(sys.stderr):
            return LLM(model, threads=threads, ctx=ctx, max_batch=1)
    except (KtError, WeightsError) as err:
        raise BackendError(f"cannot load {model}: {_first_line(err)}") from None
    except Exception as err:  # model code and transformers raise many types; the user needs one line
        raise BackendError(f"cannot load {model}: {type(err).__name__}: {_first_line(err)}") from None


def _display_name(model: str | Path) -> str:
    path = Path(model).expanduser()
    return path.name if path.exists() else str(model)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
