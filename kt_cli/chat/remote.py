"""Backend over an OpenAI-compatible server (`kt run`, or any other): POST /chat/completions
with stream=true and read the server-sent events. An API key, if the server wants one, comes
from $KT_API_KEY or $OPENAI_API_KEY. The HTTP read runs on a worker thread so
that a cancel is seen at once, even while the server is still busy with the prompt."""

import json
import os
import queue
import threading
from collections.abc import Iterator

import httpx

from .backend import BackendError, Chunk, ContextOverflow, ReplyEnd, Sampling

CONNECT_TIMEOUT_S = 5.0
API_KEY_ENV = ("KT_API_KEY", "OPENAI_API_KEY")
POLL_S = 0.05
_DONE = object()


class RemoteBackend:
    def __init__(self, url: str, model: str | None = None):
        self.url = url
        self.where = url
        self.client = httpx.Client(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S), headers=_auth_headers())
        self.model_name, self.ctx = self._pick_model(model)

    def stream(self, messages: list[dict], sampling: Sampling, cancel: threading.Event) -> Iterator[Chunk]:
        reader = _SSEReader(self.client, f"{self.url}/chat/completions", self._body(messages, sampling))
        reader.start()
        try:
            yield from _relay(reader, cancel)
        finally:
            reader.stop()

    def close(self) -> None:
        self.client.close()

    def _pick_model(self, wanted: str | None) -> tuple[str, int | None]:
        listing = _get_json(self.client, f"{self.url}/models")
        models = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(models, list) or not models:
            raise BackendError(f"{self.url}/models lists no model")
        ids = [m.get("id") for m in models if isinstance(m, dict)]
        if wanted is not None and wanted not in ids:
            raise BackendError(f"the server at {self.url} has no model {wanted!r}; it has: {', '.join(map(str, ids))}")
        chosen = models[ids.index(wanted)] if wanted is not None else models[0]
        ctx = chosen.get("max_model_len") or chosen.get("context_length")
        return str(chosen.get("id")), int(ctx) if isinstance(ctx, int) else None

    def _body(self, messages: list[dict], sampling: Sampling) -> dict:
        body = {"model": self.model_name, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True},
                "temperature": sampling.temperature, "top_p": sampling.top_p}
        if sampling.max_tokens is not None:
            body["max_tokens"] = sampling.max_tokens
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        return body


class _SSEReader(threading.Thread):
    """Puts each decoded event (a dict), then _DONE or a BackendError, on `events`."""

    def __init__(self, client: httpx.Client, url: str, body: dict):
        super().__init__(daemon=True)
        self.client, self.url, self.body = client, url, body
        self.events: queue.Queue = queue.Queue()
        self.response: httpx.Response | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            with self.client.stream("POST", self.url, json=self.body) as response:
                self.response = response
                if self.stopped.is_set():
                    return
                _raise_for_status(response, self.url)
                for event in _events(response):
                    self.events.put(event)
            self.events.put(_DONE)
        except BackendError as err:
            self.events.put(err)
        except (httpx.HTTPError, OSError, ValueError, RuntimeError) as err:
            self.events.put(_DONE if self.stopped.is_set() else _connection_error(self.url, err))

    def stop(self) -> None:
        """Closing the response drops the connection; the server then aborts the request."""
        self.stopped.set()
        if self.response is not None:
            self.response.close()
        self.join(timeout=5)


def _relay(reader: _SSEReader, cancel: threading.Event) -> Iterator[Chunk]:
    usage, finish_reason = None, None
    while True:
        if cancel.is_set():
            reader.stop()
            yield Chunk(end=_end("abort", usage))
            return
        try:
            event = reader.events.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if isinstance(event, BackendError):
            raise event
        if event is _DONE:
            yield Chunk(end=_end(finish_reason or "stop", usage))
            return
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            finish_reason = choice.get("finish_reason") or finish_reason
            text = (choice.get("delta") or {}).get("content")
            if text:
                yield Chunk(text)


def _end(finish_reason: str, usage: dict | None) -> ReplyEnd:
    usage = usage or {}
    return ReplyEnd(finish_reason, usage.get("prompt_tokens"), usage.get("completion_tokens"))


def _events(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if isinstance(event, dict) and "error" in event:
            raise BackendError(f"the server stopped the reply: {_error_message(event)}")
        yield event


def _auth_headers() -> dict:
    key = next((os.environ[name] for name in API_KEY_ENV if os.environ.get(name)), None)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _get_json(client: httpx.Client, url: str):
    try:
        response = client.get(url)
    except httpx.HTTPError as err:
        raise _connection_error(url, err) from None
    _raise_for_status(response, url)
    try:
        return response.json()
    except ValueError:
        raise BackendError(f"{url} did not answer with JSON; is this an OpenAI-compatible /v1 URL?") from None


def _raise_for_status(response: httpx.Response, url: str) -> None:
    if response.status_code < 400:
        return
    response.read()
    try:
        message = _error_message(response.json())
    except ValueError:
        message = response.text.strip()[:200] or response.reason_phrase
    error = ContextOverflow if "context" in message.lower() else BackendError
    raise error(f"the server answered {response.status_code}: {message}")


def _error_message(document) -> str:
    error = document.get("error") if isinstance(document, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    if isinstance(document, dict) and "detail" in document:
        return str(document["detail"])
    return str(error or document)


def _connection_error(url: str, err: Exception) -> BackendError:
    reason = str(err).strip() or type(err).__name__
    return BackendError(f"cannot reach the server at {url}: {reason.splitlines()[0]}")
