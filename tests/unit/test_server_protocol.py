"""The server's request parsing, options, metrics text and the engine-thread bridge, without a
model: request bodies -> SamplingParams or OpenAI-style 400s; the Prometheus text parses back
to the numbers put in; EngineLoop delivers a stub engine's outputs and refuses work past its
queue bound."""

import asyncio
import json
import re
import threading

import pytest

from kt_cli.engine.llm_engine import RequestOutput
from kt_cli.server.engine_loop import EngineLoop
from kt_cli.server.errors import APIError
from kt_cli.server.metrics import Metrics
from kt_cli.server.options import ServeOptions, ServeOptionsError
from kt_cli.server.protocol import ChatCompletionRequest, CompletionRequest, parse


def body(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def test_completion_fields_become_sampling_params():
    request = parse(body(prompt="hi", max_tokens=5, temperature=0, top_p=0.5, top_k=3, min_p=0.1, stop="x",
                         seed=7, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2), CompletionRequest)
    params = request.sampling(16)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.min_p) == (5, 0.0, 0.5, 3, 0.1)
    assert (params.stop, params.seed, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty) == (("x",), 7, 0.5, -0.5, 1.2)
    assert parse(body(prompt="hi"), CompletionRequest).sampling(16).max_tokens == 16


@pytest.mark.parametrize("prompt, want", [("text", "text"), ([5, 6], [5, 6]), (["text"], "text"), ([[5, 6]], [5, 6])])
def test_one_prompt_in_any_of_its_shapes(prompt, want):
    assert parse(body(prompt=prompt), CompletionRequest).single_prompt() == want


def test_chat_messages_and_stream_options():
    request = parse(body(messages=[{"role": "system", "content": "s"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                         stream=True, stream_options={"include_usage": True}, max_completion_tokens=9),
                    ChatCompletionRequest)
    assert request.template_messages() == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]
    assert request.stream and request.include_usage and request.sampling(100).max_tokens == 9


BAD = {
    "not json": (b"{oops", CompletionRequest, None),
    "a list": (b"[]", CompletionRequest, None),
    "model missing": (json.dumps({"prompt": "x"}).encode(), CompletionRequest, "model"),
    "max_tokens string": (body(prompt="x", max_tokens="3"), CompletionRequest, "max_tokens"),
    "max_tokens negative": (body(prompt="x", max_tokens=-1), CompletionRequest, "max_tokens"),
    "max_tokens zero": (body(prompt="x", max_tokens=0), CompletionRequest, "max_tokens"),
    "temperature negative": (body(prompt="x", temperature=-1), CompletionRequest, "temperature"),
    "temperature bool": (body(prompt="x", temperature=True), CompletionRequest, "temperature"),
    "top_p zero": (body(prompt="x", top_p=0), CompletionRequest, "top_p"),
    "stop of ints": (body(prompt="x", stop=[1]), CompletionRequest, "stop"),
    "n two": (body(prompt="x", n=2), CompletionRequest, "n"),
    "two prompts": (body(prompt=["a", "b"]), CompletionRequest, "prompt"),
    "empty prompt": (body(prompt=""), CompletionRequest, "prompt"),
    "echo": (body(prompt="x", echo=True), CompletionRequest, "echo"),
    "no messages": (body(messages=[]), ChatCompletionRequest, "messages"),
    "bad role": (body(messages=[{"role": "robot", "content": "x"}]), ChatCompletionRequest, "messages.0.role"),
    "logprobs": (body(messages=[{"role": "user", "content": "x"}], logprobs=True), ChatCompletionRequest, "logprobs"),
    "stream not bool": (body(prompt="x", stream="yes"), CompletionRequest, "stream"),
}


@pytest.mark.parametrize("raw, kind, param", BAD.values(), ids=BAD.keys())
def test_bad_bodies_are_400_naming_the_field(raw, kind, param):
    with pytest.raises(APIError) as err:
        parse(raw, kind).sampling(16)
    error = err.value.body()["error"]
    assert err.value.status == 400 and error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_options_are_validated():
    assert ServeOptions(model="m").url == "http://127.0.0.1:8000"
    assert ServeOptions(model="/x/y.gguf", api_key="").api_key is None
    assert ServeOptions(model="/nonexistent/dir/name").name_to_serve() == "/nonexistent/dir/name"
    for bad in (dict(port=70000), dict(max_batch=0), dict(host="example.com"), dict(prefix_cache_disk_gb=0),
                dict(ctx=1), dict(threads=0), dict(max_queue=-1), dict(log_level="loud")):
        with pytest.raises(ServeOptionsError):
            ServeOptions(model="m", **bad)


def test_metrics_text_parses_back():
    metrics = Metrics()
    metrics.count_request("/v1/completions", 200)
    metrics.count_request("/v1/completions", 200)
    metrics.count_request("/v1/completions", 400)
    metrics.count_tokens(30, now=100.0)
    metrics.count_finished(prompt_tokens=40, cached_tokens=10)
    metrics.engine.kv_blocks_total, metrics.engine.kv_blocks_free = 100, 75
    text = metrics.render()
    samples = dict(re.findall(r"^([^#\s][^ ]*) (\S+)$", text, re.M))
    assert samples['kt_requests_total{endpoint="/v1/completions",status="200"}'] == "2"
    assert samples['kt_requests_total{endpoint="/v1/completions",status="400"}'] == "1"
    assert samples["kt_prefix_cache_hit_rate"] == "0.25" and samples["kt_kv_blocks_used"] == "25"
    assert samples["kt_generation_tokens_total"] == "30"
    assert metrics.tokens_per_second(now=105.0) == 3.0 and metrics.tokens_per_second(now=200.0) == 0.0
    assert all(line.startswith(("# HELP", "# TYPE", "kt_")) for line in text.strip().splitlines())


class StubEngine:
    """Finishes each request after `steps` steps with one token per step."""

    def __init__(self, steps: int = 3):
        self.steps, self.live, self.aborted = steps, {}, []
        self.gate = threading.Event()     # steps wait until the test opens it
        self.scheduler = type("S", (), {"waiting": [], "running": [], "num_preemptions": 0})()
        self.block_manager = type("B", (), {"num_blocks": 10, "num_free_blocks": 10})()

    def add_request(self, prompt, params, request_id):
        self.live[request_id] = (len(prompt), 0)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def has_unfinished(self):
        return bool(self.live) or bool(self.aborted)

    def step(self):
        self.gate.wait(timeout=10)
        outputs = []
        for request_id in self.aborted:
            if request_id in self.live:
                prompt, done = self.live.pop(request_id)
                outputs.append(RequestOutput(request_id, [], "", True, "abort", prompt, 0, done))
        self.aborted = []
        for request_id, (prompt, done) in list(self.live.items()):
            done += 1
            finished = done == self.steps
            outputs.append(RequestOutput(request_id, [done], f"t{done}", finished,
                                         "length" if finished else None, prompt, 0, done))
            if finished:
                del self.live[request_id]
            else:
                self.live[request_id] = (prompt, done)
        return outputs


def test_engine_loop_delivers_outputs_and_bounds_its_queue():
    metrics = Metrics()
    engine = StubEngine(steps=3)
    loop = EngineLoop(engine, metrics, max_pending=2)

    async def scenario():
        first, second = loop.submit([1, 2], None), loop.submit([3], None)
        with pytest.raises(APIError) as err:
            loop.submit([4], None)
        assert err.value.status == 503
        engine.gate.set()
        texts = [[o.text_delta async for o in h.outputs()] for h in (first, second)]
        third = loop.submit([5], None)
        assert [o.finish_reason async for o in third.outputs()][-1] == "length"
        return texts

    loop.start()
    try:
        texts = asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        loop.stop(timeout=5)
    assert texts == [["t1", "t2", "t3"], ["t1", "t2", "t3"]]
    assert metrics.finished_requests == 3 and metrics.generation_tokens == 9 and metrics.in_flight == 0
    assert not loop.thread.is_alive()


def test_shutdown_refuses_new_work_and_aborts_what_is_left_after_the_grace_period():
    engine = StubEngine(steps=10**6)
    engine.gate.set()
    loop = EngineLoop(engine, Metrics(), max_pending=4)

    async def scenario():
        handle = loop.submit([1], None)
        loop.begin_shutdown(grace_s=0.2)
        with pytest.raises(APIError) as err:
            loop.submit([2], None)
        assert err.value.status == 503
        return [o async for o in handle.outputs()]

    loop.start()
    try:
        outputs = asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        loop.stop(timeout=5)
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort" and len(outputs) > 1
