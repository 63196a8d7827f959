"""`kt chat` pieces without a model: option checks, the conversation file, and the HTTP
backend against a scripted OpenAI-style server (the real server is in test_chat.py)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kt_cli.chat import ChatError, ChatOptions
from kt_cli.chat.backend import BackendError, ContextOverflow, Sampling
from kt_cli.chat.conversation import Conversation
from kt_cli.chat.remote import RemoteBackend
from kt_cli.chat.session import ChatSession, ReplyStats


@pytest.mark.parametrize("options, message", [
    (dict(temperature=-0.1), "--temperature must be a number >= 0"),
    (dict(top_p=0), r"--top-p must be in \(0, 1\]"),
    (dict(max_tokens=0), "--max-tokens must be an integer >= 1"),
    (dict(threads=0), "--threads must be an integer >= 1"),
    (dict(ctx=1), "--ctx must be an integer >= 2"),
    (dict(prompt="  "), "--prompt is empty"),
    (dict(url="localhost:8000"), "--url must look like http://host:port/v1"),
    (dict(url="http://h:1/v1", threads=2), "--threads set the in-process model"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ChatError, match=message):
        ChatOptions(**options)


@pytest.mark.parametrize("given, normalized", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1"),
    ("https://example.org/api/v1", "https://example.org/api/v1"),
])
def test_url_is_normalized(given, normalized):
    assert ChatOptions(url=given).url == normalized


@pytest.mark.parametrize("temperature, one_shot, expected", [
    (None, True, 0.0), (None, False, 0.8), (0.5, True, 0.5), (0.0, False, 0.0),
])
def test_default_temperature_is_greedy_only_for_one_shot_answers(temperature, one_shot, expected):
    from kt_cli.chat.app import sampling_of
    assert sampling_of(ChatOptions(temperature=temperature), one_shot).temperature == expected


def test_conversation_round_trips_through_its_file(tmp_path):
    conversation = Conversation("Be brief.", [])
    conversation.add("user", "Héllo\nthere")
    conversation.add("assistant", "Hi ✓")
    path = conversation.save(tmp_path / "c.json", model="m")
    assert json.loads(path.read_text(encoding="utf-8")) == {
        "format": "kt.chat/1", "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo\nthere"},
                     {"role": "assistant", "content": "Hi ✓"}]}
    assert Conversation.load(path) == conversation
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


@pytest.mark.parametrize("text, message", [
    ("not json", "is not a JSON file"),
    ('{"messages": 3}', "is not a saved conversation"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "message 0 needs a role"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]}',
     "only the first message may have the role 'system'"),
    ('{"format": "other/9", "messages": []}', "has format 'other/9'"),
])
def test_bad_conversation_files_are_refused(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ChatError, match=message):
        Conversation.load(path)


def test_a_failed_save_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text("old")
    monkeypatch.setattr("kt_cli.chat.conversation.os.replace", _raise(OSError(28, "No space left on device")))
    with pytest.raises(ChatError, match="No space left on device"):
        Conversation(None, [{"role": "user", "content": "x"}]).save(path)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def _raise(error):
    def fail(*args, **kwargs):
        raise error
    return fail


def test_stats_line():
    stats = ReplyStats("abc", "length", tokens=11, prompt_tokens=5, ttft_s=0.5, seconds=1.5, context_full=False)
    assert stats.tokens_per_s == pytest.approx(10.0)
    assert stats.summary() == "11 tokens · first token 0.50 s · 10.0 tok/s · max tokens reached"


class ScriptedServer:
    """/v1/models and a streaming /v1/chat/completions that sends `pieces` one per `delay_s`;
    records request bodies and whether the client hung up before the end."""

    def __init__(self, pieces: list[str], delay_s: float = 0.0, status: int = 200, error: str = ""):
        self.pieces, self.delay_s, self.status, self.error = pieces, delay_s, status, error
        self.bodies: list[dict] = []
        self.hung_up = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._json(200, {"object": "list", "data": [{"id": "scripted", "max_model_len": 99}]})

            def do_POST(self):
                server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                if server.status != 200:
                    return self._json(server.status, {"error": {"message": server.error}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    self._stream()
                except (BrokenPipeError, ConnectionResetError):
                    server.hung_up.set()

            def _stream(self):
                for piece in server.pieces:
                    time.sleep(server.delay_s)
                    self._event({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
                self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                self._event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": len(server.pieces)}})
                self.wfile.write(b"data: [DONE]\n\n")

            def _event(self, body):
                self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
                self.wfile.flush()

            def _json(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    servers = []

    def start(*args, **kwargs) -> ScriptedServer:
        servers.append(ScriptedServer(*args, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_remote_reply_streams_and_sends_the_options(scripted):
    server = scripted(["Par", "is", "."])
    backend = RemoteBackend(server.url)
    session = ChatSession(backend, Conversation("Be brief."), Sampling(0.5, 0.7, 5, 3))
    shown = []
    stats = session.reply("Capital of France?", shown.append, threading.Event())
    assert (backend.model_name, backend.ctx) == ("scripted", 99)
    assert shown == ["Par", "is", "."] and stats.text == "Paris."
    assert (stats.finish_reason, stats.tokens, stats.prompt_tokens) == ("stop", 3, 7)
    assert server.bodies == [{
        "model": "scripted", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
        "temperature": 0.5, "top_p": 0.7, "max_tokens": 5, "seed": 3}]
    assert session.conversation.turns[-1] == {"role": "assistant", "content": "Paris."}
    backend.close()


def test_remote_cancel_hangs_up_and_keeps_what_was_shown(scripted):
    server = scripted([f"w{i} " for i in range(200)], delay_s=0.02)
    backend = RemoteBackend(server.url)
    session = ChatSession(backend, Conversation(), Sampling(0.0, 1.0, None, None))
    cancel, shown = threading.Event(), []

    def show(text):
        shown.append(text)
        if len(shown) == 3:
            cancel.set()

    stats = session.reply("go", show, cancel)
    assert stats.finish_reason == "abort" and stats.text == "w0 w1 w2 "
    assert session.conversation.turns == [{"role": "user", "content": "go"},
                                          {"role": "assistant", "content": "w0 w1 w2 "}]
    assert server.hung_up.wait(timeout=10)
    backend.close()


@pytest.mark.parametrize("error, kind", [
    ("This model's context is 99 tokens and the prompt has 120", ContextOverflow),
    ("the chat template rejected these messages", BackendError),
])
def test_remote_errors_become_one_line(scripted, error, kind):
    server = scripted([], status=400, error=error)
    backend = RemoteBackend(server.url)
    session = ChatSession(backend, Conversation(), Sampling(0.0, 1.0, None, None))
    with pytest.raises(kind, match=f"the server answered 400: {error}"):
        session.reply("hi", print, threading.Event())
    assert session.conversation.turns == []
    backend.close()


def test_remote_model_must_exist(scripted):
    with pytest.raises(BackendError, match="has no model 'other'; it has: scripted"):
        RemoteBackend(scripted([]).url, "other")
