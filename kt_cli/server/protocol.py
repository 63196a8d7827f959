"""Request bodies of the OpenAI API, checked strictly: wrong types and bad values become a 400
naming the field. Unknown fields are ignored, as OpenAI clients send several we do not use."""

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.sampling_params import SamplingParams, SamplingParamsError
from .errors import bad_request

DEFAULT_COMPLETION_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise bad_request(f"n={self.n} is not supported: this server returns one choice per request", "n")

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        values = dict(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens)
        try:
            return SamplingParams(**values)
        except SamplingParamsError as err:
            raise bad_request(str(err), _param_named_in(str(err), values)) from None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise bad_request("logprobs are not supported by this server", "logprobs")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    def template_messages(self) -> list[dict]:
        return [message.as_template_dict() for message in self.messages]


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("echo", "suffix", "logprobs"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported by this server", name)
        if self.best_of not in (None, 1):
            raise bad_request("best_of > 1 is not supported by this server", "best_of")
        self.single_prompt()

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"{len(prompt)} prompts in one request; send one prompt per request",
                                  "prompt")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise bad_request("prompt is empty", "prompt")
        return prompt


def parse(raw: bytes, model_class: type[_GenerationRequest]) -> _GenerationRequest:
    """JSON bytes -> a checked request, or an APIError(400)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad_request(f"The request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    try:
        request = model_class.model_validate(data)
    except ValidationError as err:
        raise _validation_error(err) from None
    request.check_supported()
    return request


def _validation_error(err: ValidationError):
    first = err.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if not _is_union_branch(part)]
    param = ".".join(loc) or None
    return bad_request(f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)


def _is_union_branch(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list[int]", "list[str]")
                                      or part.startswith(("list[", "function-")))


def _param_named_in(message: str, values: dict) -> str | None:
    detail = message.split(":", 1)[-1].strip()
    return next((name for name in values if detail.startswith(name)), None)
