"""Response bodies and stream chunks of the OpenAI API, as plain dicts."""

import json
import time
import uuid
from dataclasses import dataclass, field

from ..engine.llm_engine import RequestOutput

DONE = "data: [DONE]\n\n"


@dataclass
class Reply:
    """Identity of one response, shared by all its chunks."""
    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def full(self, text: str, last: RequestOutput) -> dict:
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return self._envelope(self.object, [choice], usage(last))

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, last: RequestOutput) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, [], usage(last))

    def _envelope(self, kind: str, choices: list[dict], usage_body: dict | None = None) -> dict:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, "system_fingerprint": None}
        if usage_body is not None:
            body["usage"] = usage_body
        return body


def usage(last: RequestOutput) -> dict:
    completion = last.num_generated_tokens
    return {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": last.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens}}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def models_list(name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "kt"}]}
