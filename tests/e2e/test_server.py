"""`python -m kt_cli.server` as a real process on a loopback port, driven by the official
openai client and httpx. The reference is kt's own engine (kt_cli.LLM in this process) on the
same tiny random Llama with the SmolLM2 tokenizer: at temperature 0 the server must return the
same text, alone or among 32 concurrent streams. Then: errors in OpenAI's shape, disconnects
freeing KV blocks, prefix-cache hits (also after a restart through the disk tier), a corrupt
cache file skipped, a full queue answered with 503."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from kt_cli import LLM, SamplingParams
from kt_cli.engine.block_manager import chain_hash
from kt_weights.checkpoint import open_checkpoint

pytestmark = pytest.mark.slow

KEY = "test-key-123"
CTX = 2048
BLOCK = 16
START_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 60
GREEDY = dict(temperature=0.0)


class ServerProcess:
    def __init__(self, model_dir: Path, cache_dir: Path, log: Path, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [sys.executable, "-m", "kt_cli.server", "--model", str(model_dir), "--port", str(self.port),
                "--api-key", KEY, "--ctx", str(CTX), "--kv-memory-gb", "0.02", "--threads", "1",
                "--prefix-cache-disk", str(cache_dir), "--shutdown-timeout-s", "0", *extra]
        env = dict(os.environ, HF_HUB_OFFLINE="1", KT_API_KEY="")
        self.proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        pytest.fail(f"server not healthy within {START_TIMEOUT_S}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, timeout=REQUEST_TIMEOUT_S, **kwargs)

    def metrics(self) -> dict[str, float]:
        return _samples(httpx.get(f"{self.url}/metrics", timeout=10).text)


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tiny_llama(directory: Path, tokenizer) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=CTX, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise / p.shape[-1] ** 0.5 if p.dim() >= 2 else 1.0 + 0.1 * noise)
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_gguf):
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    try:
        with open_checkpoint(smollm2_gguf) as ckpt:
            tokenizer = ckpt.tokenizer()
        yield build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), tokenizer)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("prefix_cache")


@pytest.fixture(scope="module")
def server(model_dir, cache_dir, tmp_path_factory):
    proc = ServerProcess(model_dir, cache_dir, tmp_path_factory.mktemp("logs") / "server.log",
                         "--max-batch", "8", "--max-queue", "40")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def llm(model_dir, server):
    """The reference engine; loads while the server process starts, then waits for it."""
    engine = LLM(str(model_dir), ctx=CTX, kv_memory_gb=0.02, threads=1)
    server.wait_ready()
    return engine


def greedy(llm: LLM, prompt, max_tokens: int, **extra):
    params = SamplingParams(max_tokens=max_tokens, **GREEDY, **extra)
    return llm.generate([prompt], params)[0]


def chat_text(llm: LLM, messages, max_tokens: int) -> str:
    return llm.chat(messages, SamplingParams(max_tokens=max_tokens, **GREEDY)).text


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


# --- agreement with the engine ---------------------------------------------------------------

def test_models_and_health(server, llm, model_dir):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert [m.id for m in server.client().models.list().data] == [model_dir.name]


def test_completion_at_temperature_zero_equals_the_engine(server, llm, model_dir):
    prompt = "The capital of France is"
    want = greedy(llm, prompt, 12)
    reply = server.client().completions.create(model=model_dir.name, prompt=prompt, max_tokens=12, **GREEDY)
    assert reply.choices[0].text == want.text
    assert reply.choices[0].finish_reason == want.finish_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (want.num_prompt_tokens, len(want.token_ids))
    stream = server.client().completions.create(model=model_dir.name, prompt=prompt, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_at_temperature_zero_equals_the_engine(server, llm, model_dir):
    want = llm.chat(MESSAGES, SamplingParams(max_tokens=10, **GREEDY))
    reply = server.client().chat.completions.create(model=model_dir.name, messages=MESSAGES, max_tokens=10, **GREEDY)
    assert reply.choices[0].message.content == want.text and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(llm.chat_prompt(MESSAGES))
    chunks = list(server.client().chat.completions.create(
        model=model_dir.name, messages=MESSAGES, max_tokens=10, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_raw_stream_is_sse_ending_with_done(server, llm, model_dir):
    body = {"model": model_dir.name, "prompt": "Hello", "max_tokens": 3, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=REQUEST_TIMEOUT_S) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_string_and_seeded_sampling(server, llm, model_dir):
    full = greedy(llm, "Once upon a time", 12).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"degenerate reference text {full!r}"
    reply = server.client().completions.create(model=model_dir.name, prompt="Once upon a time", max_tokens=12,
                                               stop=[stop], **GREEDY)
    assert reply.choices[0].text == full[:full.index(stop)] and reply.choices[0].finish_reason == "stop"
    sampled = [server.client().completions.create(model=model_dir.name, prompt="Once", max_tokens=8,
                                                  temperature=1.0, top_p=0.9, seed=42).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_32_concurrent_streams_each_equal_their_solo_greedy_output(server, llm, model_dir):
    prompts = [" ".join(["word"] * (1 + i * 3)) + f" number {i}" for i in range(32)]
    lengths = [3 + i % 8 for i in range(32)]
    want = [greedy(llm, p, n).text for p, n in zip(prompts, lengths)]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=REQUEST_TIMEOUT_S)

    async def one(prompt: str, max_tokens: int) -> str:
        stream = await client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=max_tokens,
                                                 stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them():
        return await asyncio.wait_for(asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths))), 120)

    assert asyncio.run(all_of_them()) == want
    assert server.metrics()["kt_requests_in_flight"] == 0


# --- errors ------------------------------------------------------------------------------------

def _post(server, path: str, content: bytes | str, key: str | None = KEY) -> httpx.Response:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=REQUEST_TIMEOUT_S)


def bad_cases(name: str) -> dict[str, tuple[str, dict | bytes, int, str | None]]:
    long_prompt = list(range(100, 100 + CTX + 5))
    return {
        "malformed json": ("/v1/completions", b'{"model": "x", "prompt": ', 400, None),
        "not an object": ("/v1/chat/completions", b"[1, 2]", 400, None),
        "max_tokens as string": ("/v1/completions", dict(model=name, prompt="hi", max_tokens="5"), 400, "max_tokens"),
        "temperature as list": ("/v1/completions", dict(model=name, prompt="hi", temperature=[1]), 400, "temperature"),
        "messages missing": ("/v1/chat/completions", dict(model=name), 400, "messages"),
        "bad role": ("/v1/chat/completions", dict(model=name, messages=[{"role": "bot", "content": "x"}]), 400, None),
        "negative max_tokens": ("/v1/completions", dict(model=name, prompt="hi", max_tokens=-3), 400, "max_tokens"),
        "top_p above one": ("/v1/chat/completions", dict(model=name, messages=MESSAGES, top_p=1.5), 400, "top_p"),
        "n above one": ("/v1/completions", dict(model=name, prompt="hi", n=2), 400, "n"),
        "token id outside vocab": ("/v1/completions", dict(model=name, prompt=[1, 10**9]), 400, "prompt"),
        "prompt over context": ("/v1/completions", dict(model=name, prompt=long_prompt), 400, None),
        "unknown model": ("/v1/completions", dict(model="no-such-model", prompt="hi"), 404, "model"),
    }


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, llm, model_dir):
    for what, (path, body, status, param) in bad_cases(model_dir.name).items():
        raw = body if isinstance(body, bytes) else json.dumps(body)
        response = _post(server, path, raw)
        assert response.status_code == status, (what, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], what
        if param is not None:
            assert error["param"] == param, (what, error)
    long = _post(server, "/v1/completions", json.dumps(dict(model=model_dir.name, prompt=list(range(100, 100 + CTX)))))
    assert long.json()["error"]["code"] == "context_length_exceeded"
    for key in (None, "wrong-key"):
        response = _post(server, "/v1/completions", json.dumps(dict(model=model_dir.name, prompt="hi")), key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        server.client(max_retries=0).completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        server.client(max_retries=0).completions.create(model=model_dir.name, prompt="hi", max_tokens=-1)
    assert server.client().completions.create(model=model_dir.name, prompt="still alive", max_tokens=2).choices
    counts = server.metrics()
    assert counts['kt_requests_total{endpoint="/v1/completions",status="400"}'] >= 8
    assert counts['kt_requests_total{endpoint="/v1/completions",status="401"}'] >= 2


# --- cancellation ------------------------------------------------------------------------------

def test_disconnect_mid_stream_frees_kv_blocks(server, llm, model_dir):
    body = {"model": model_dir.name, "prompt": "A long story:", "max_tokens": 1500, "stream": True,
            "ignore_eos": True, **GREEDY}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=REQUEST_TIMEOUT_S) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        busy = server.metrics()
    assert busy["kt_kv_blocks_used"] > 0 and busy["kt_requests_in_flight"] == 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = server.metrics()
        if now["kt_kv_blocks_used"] == 0 and now["kt_requests_in_flight"] == 0:
            break
        time.sleep(0.2)
    assert (now["kt_kv_blocks_used"], now["kt_requests_in_flight"]) == (0, 0)
    assert now["kt_generation_tokens_total"] - busy["kt_generation_tokens_total"] < 1000


def test_a_non_streaming_client_that_hangs_up_stops_its_request(server, llm, model_dir):
    """The client hangs up once the server is seen generating (not after a fixed time: a fast
    machine generated the whole 1500 tokens' worth of a 1.5 s timeout), and the request must then
    stop well short of max_tokens."""
    body = {"model": model_dir.name, "prompt": "Another long story:", "max_tokens": CTX - 64, "ignore_eos": True}
    before = server.metrics()["kt_generation_tokens_total"]
    with _raw_request(server, "/v1/completions", body):
        at_hangup = _wait_for_tokens(server, before + 20)
    deadline = time.monotonic() + 20
    while server.metrics()["kt_requests_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.2)
    now = server.metrics()
    assert (now["kt_kv_blocks_used"], now["kt_requests_in_flight"]) == (0, 0)
    assert now["kt_generation_tokens_total"] - at_hangup < body["max_tokens"] // 2


class _raw_request:
    """A POST sent on a plain socket, which closing the context hangs up without reading the reply."""

    def __init__(self, server, path: str, body: dict):
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        self.sock.sendall(head.encode() + payload)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()


def _wait_for_tokens(server, total: float) -> float:
    """Polls the generation counter until it reaches total; returns the count then."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while time.monotonic() < deadline:
        count = server.metrics()["kt_generation_tokens_total"]
        if count >= total:
            return count
        time.sleep(0.05)
    pytest.fail(f"the server did not reach {total:.0f} generated tokens in {REQUEST_TIMEOUT_S} s")


# --- prefix cache ------------------------------------------------------------------------------

def document(seed: int) -> str:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    return " ".join(words[(seed * 7 + i * i) % 10] + str(i % 13) for i in range(500))


def _cached_tokens(server, name: str, messages) -> int:
    """The prompt tokens a one-token reply reports as served from the prefix cache."""
    reply = server.client().chat.completions.create(model=name, messages=messages, max_tokens=1, **GREEDY)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_shared_prefix_is_cached(server, llm, model_dir):
    """The second question over the same document is served from the prefix cache (how
    much sooner it answers is bench/serve.py's figure: a timed assertion here failed on a
    loaded machine once prefill got faster)."""
    before = server.metrics()["kt_prefix_cache_cached_tokens_total"]
    reported = 0
    for seed in range(3):
        doc = {"role": "system", "content": document(seed)}
        cached = _cached_tokens(server, model_dir.name, [doc, {"role": "user", "content": "First question?"}])
        assert cached == 0
        cached = _cached_tokens(server, model_dir.name, [doc, {"role": "user", "content": "Second question?"}])
        assert cached >= len(llm.chat_prompt([doc])) - 2 * BLOCK
        reported += cached
    assert server.metrics()["kt_prefix_cache_cached_tokens_total"] - before == reported
    assert server.metrics()["kt_prefix_cache_hit_rate"] > 0


# --- restart with the disk tier, corrupt files, a full queue ------------------------------------

KEEP = list(range(1000, 1100))
BROKEN = list(range(2000, 2100))


def block_file(cache_dir: Path, prompt: list[int], index: int) -> Path:
    digest = None
    for i in range(index + 1):
        digest = chain_hash(digest, prompt[i * BLOCK:(i + 1) * BLOCK])
    return cache_dir / f"{digest.hex()}.kvb"


def _read_long_stream(server, name: str, out: dict) -> None:
    body = {"model": name, "prompt": "Interrupted story:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=REQUEST_TIMEOUT_S) as response:
        lines = []
        for line in response.iter_lines():
            lines.append(line)
            out["open_stream"] = lines


@pytest.fixture(scope="module")
def restarted(server, llm, model_dir, cache_dir, tmp_path_factory):
    """Serve KEEP and BROKEN, stop (SIGTERM), damage the cache, start again with a one-slot queue."""
    client = server.client()
    first = {name: client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=4, **GREEDY)
             for name, prompt in (("keep", KEEP), ("broken", BROKEN))}
    open_stream = threading.Thread(target=_read_long_stream, args=(server, model_dir.name, first), daemon=True)
    open_stream.start()
    deadline = time.monotonic() + 30
    while "open_stream" not in first and time.monotonic() < deadline:
        time.sleep(0.1)
    server.stop()
    open_stream.join(timeout=30)
    assert block_file(cache_dir, KEEP, 5).exists() and block_file(cache_dir, BROKEN, 0).exists()
    broken = block_file(cache_dir, BROKEN, 0)
    data = bytearray(broken.read_bytes())
    data[-5] ^= 0xFF
    broken.write_bytes(bytes(data))
    (cache_dir / f"{'ab' * 16}.kvb").write_bytes(b"garbage that is not a block")
    proc = ServerProcess(model_dir, cache_dir, tmp_path_factory.mktemp("logs2") / "server.log",
                         "--max-batch", "1", "--max-queue", "0")
    try:
        proc.wait_ready()
        yield proc, first
    finally:
        proc.stop()


def test_prefix_hit_survives_a_restart_and_a_corrupt_file_is_skipped(restarted, model_dir, cache_dir):
    proc, first = restarted
    assert not (cache_dir / f"{'ab' * 16}.kvb").exists()
    client = proc.client()
    keep = client.completions.create(model=model_dir.name, prompt=KEEP, max_tokens=4, **GREEDY)
    assert keep.usage.prompt_tokens_details.cached_tokens == (len(KEEP) - 1) // BLOCK * BLOCK
    assert keep.choices[0].text == first["keep"].choices[0].text
    broken = client.completions.create(model=model_dir.name, prompt=BROKEN, max_tokens=4, **GREEDY)
    assert broken.usage.prompt_tokens_details.cached_tokens == 0
    assert broken.choices[0].text == first["broken"].choices[0].text
    counts = proc.metrics()
    assert counts['kt_prefix_tier_rejected_total{tier="disk"}'] >= 2
    assert counts["kt_prefix_cache_restored_blocks_total"] >= 6


def test_shutdown_ends_an_open_stream_cleanly(restarted):
    """No grace period (--shutdown-timeout-s 0): with 2 s, a fast host finished all 1500 tokens first."""
    _, first = restarted
    events = [line for line in first["open_stream"] if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 1500


def test_a_full_queue_gets_503_and_the_server_recovers(restarted, model_dir):
    proc, _ = restarted
    body = {"model": model_dir.name, "prompt": "Hold the only slot", "max_tokens": 1500, "ignore_eos": True,
            "stream": True, **GREEDY}
    with httpx.stream("POST", f"{proc.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=REQUEST_TIMEOUT_S) as holder:
        lines = holder.iter_lines()      # keep a reference: a collected iterator closes the connection
        next(lines)
        with pytest.raises(openai.APIStatusError) as err:
            proc.client(max_retries=0).completions.create(model=model_dir.name, prompt="hi", max_tokens=2)
        assert err.value.status_code == 503 and err.value.body["code"] == "queue_full"
    deadline = time.monotonic() + 20
    while proc.metrics()["kt_requests_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.client().completions.create(model=model_dir.name, prompt="hi", max_tokens=2).choices
