"""`kt chat` end to end: real pseudo-terminal sessions (pexpect) on a tiny random Llama with
SmolLM2's tokenizer and chat template, whose greedy replies are checked against Hugging Face
transformers' own generate(); one-shot modes on the default SmolLM2 model; --url against
`python -m kt_cli.server`."""

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pexpect
import pytest
import torch
import transformers

from kt_weights.checkpoint import open_checkpoint

pytestmark = pytest.mark.slow

SYSTEM = "You are a test."
MAX_TOKENS = 8
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]|\x1b[=>78]")
STATS = r"(\d+) tokens · first token [\d.]+ s"
FRANCE = "What is the capital of France?"


class TinyChatModel:
    """A random LlamaForCausalLM (untied head, weights scaled so greedy replies vary) saved
    with save_pretrained beside SmolLM2's tokenizer; `reply` is transformers' greedy answer."""

    def __init__(self, directory: Path, tokenizer):
        self.directory, self.tokenizer = directory, tokenizer
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        self.model = transformers.LlamaForCausalLM(config).eval()
        _randomize(self.model, seed=0)
        self.model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    def reply(self, messages: list[dict], max_tokens: int = MAX_TOKENS) -> str:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens,
                                      do_sample=False, eos_token_id=self.tokenizer.eos_token_id,
                                      pad_token_id=self.tokenizer.eos_token_id)
        return self.tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "embed" in name:
                p.copy_(noise)
            elif p.dim() >= 2:
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:
                p.copy_(1 + 0.1 * noise)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf) -> TinyChatModel:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        with open_checkpoint(smollm2_gguf) as ckpt:
            tokenizer = ckpt.tokenizer()
    return TinyChatModel(tmp_path_factory.mktemp("tiny-chat"), tokenizer)


def chat_env(home: Path) -> dict:
    return dict(os.environ, KT_HOME=str(home), HF_HUB_OFFLINE="1", PROMPT_TOOLKIT_NO_CPR="1",
                TERM="xterm", COLUMNS="200")


def chat_args(*args) -> list[str]:
    return ["-m", "kt_cli.chat", *map(str, args)]


class Screen:
    """What a terminal shows, escape sequences stripped; wait_for moves a cursor forward."""

    def __init__(self, child: pexpect.spawn):
        self.child, self.raw, self.pos = child, "", 0

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw).replace("\r", "")

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match:
        regex, deadline = re.compile(pattern), time.monotonic() + timeout
        while True:
            found = regex.search(self.text, self.pos)
            if found:
                self.pos = found.end()
                return found
            if time.monotonic() > deadline or not self.child.isalive() and not self._pending():
                raise AssertionError(f"the screen never showed {pattern!r}; it ends with:\n{self.text[-1500:]}")
            self._pending()

    def _pending(self) -> bool:
        try:
            self.raw += self.child.read_nonblocking(65536, timeout=0.2)
            return True
        except (pexpect.TIMEOUT, pexpect.EOF):
            return False

    def since(self, start: int) -> str:
        return self.text[start:self.pos]

    def command(self, line: str, answer: str) -> re.Match:
        self.child.sendline(line)
        found = self.wait_for(answer)
        self.wait_for(">>>")
        return found

    def say(self, line: str) -> tuple[int, str]:
        """Send a message; (generated tokens, screen text from the message to the stats line)."""
        start = self.pos
        self.child.sendline(line)
        stats = self.wait_for(STATS)
        shown = self.since(start)
        self.wait_for(">>>")
        return int(stats.group(1)), shown


def squeeze(text: str) -> str:
    return "".join(text.split())


def spawn_chat(tiny: TinyChatModel, home: Path, *options) -> tuple[pexpect.spawn, Screen]:
    child = pexpect.spawn(sys.executable, chat_args(tiny.directory, "--temperature", 0, "--threads", 1, *options),
                          env=chat_env(home), encoding="utf-8", dimensions=(50, 200), timeout=120)
    screen = Screen(child)
    screen.wait_for(f"kt chat · {tiny.directory.name}")
    screen.wait_for(">>>")
    return child, screen


def test_interactive_session(tiny, tmp_path):
    child, screen = spawn_chat(tiny, tmp_path / "home", "--max-tokens", MAX_TOKENS, "--system", SYSTEM)
    try:
        conversation = [{"role": "system", "content": SYSTEM}]
        for lines, sent in ((["Hello there"], "Hello there"),
                            (["What about\\", "line two?"], "What about\nline two?")):
            expected = tiny.reply(conversation + [{"role": "user", "content": sent}])
            for line in lines[:-1]:
                child.sendline(line)
            tokens, shown = screen.say(lines[-1])
            assert tokens == MAX_TOKENS
            assert squeeze(expected) in squeeze(shown)
            conversation += [{"role": "user", "content": sent}, {"role": "assistant", "content": expected}]

        saved = tmp_path / "conversation.json"
        screen.command(f"/save {saved}", "saved 5 messages")
        assert json.loads(saved.read_text()) == {"format": "kt.chat/1", "model": tiny.directory.name,
                                                 "messages": conversation}
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

        screen.command("/clear", "new conversation")
        _, shown = screen.say("Hello there")
        assert squeeze(conversation[2]["content"]) in squeeze(shown)   # same answer as turn one

        screen.command(f"/load {saved}", "loaded 4 messages and a system prompt")
        follow_up = conversation + [{"role": "user", "content": "And then?"}]
        _, shown = screen.say("And then?")
        assert squeeze(tiny.reply(follow_up)) in squeeze(shown)

        _check_ctrl_c_stops_the_reply(tiny, child, screen, tmp_path, follow_up)
        screen.command("/frobnicate", "unknown command /frobnicate")
        screen.command("/stats", r"replies\s+6, ")
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=30)
        child.close()
        assert child.exitstatus == 0
    finally:
        child.terminate(force=True)


def _check_ctrl_c_stops_the_reply(tiny, child, screen, tmp_path, conversation):
    conversation = conversation + [{"role": "assistant", "content": tiny.reply(conversation)}]
    screen.command("/set max_tokens 100000", "max_tokens = 100000")
    child.sendline("Tell me a long story")
    screen.wait_for(r"Tell me a long story\n[\s\S]{12}")
    child.sendintr()
    stats = screen.wait_for(STATS + r".* · stopped")
    screen.wait_for(">>>")
    stopped_after = int(stats.group(1))
    assert 0 < stopped_after < 300

    saved = tmp_path / "stopped.json"
    screen.command(f"/save {saved}", "saved 9 messages")
    kept = json.loads(saved.read_text())["messages"]
    assert kept[:-2] == conversation and kept[-2]["content"] == "Tell me a long story"
    full = tiny.reply(conversation + [kept[-2]], max_tokens=stopped_after + 8)
    assert kept[-1]["content"] and full.startswith(kept[-1]["content"])
    assert squeeze(kept[-1]["content"]) in squeeze(screen.text)

    screen.command(f"/set max_tokens {MAX_TOKENS}", f"max_tokens = {MAX_TOKENS}")
    tokens, _ = screen.say("Short one")      # the engine let the stopped request go
    assert tokens == MAX_TOKENS
