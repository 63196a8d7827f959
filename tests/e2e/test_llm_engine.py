"""The engine loop on a tiny test-only attention model that reads and writes the paged KV
cache, checked against the same model recomputed densely over the whole sequence."""

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kt_cli.engine.forward_batch import ForwardBatch, KVSpec
from kt_cli.engine.llm_engine import EngineConfig, LLMEngine
from kt_cli.engine.sampling_params import SamplingParams
from kt_cli.errors import KtError

VOCAB, DIM, HEADS, KV_HEADS, MAX_POS = 48, 32, 4, 2, 128
HEAD_DIM = DIM // HEADS
EOS = 1


class TinyPagedLM:
    """One GQA attention layer with learned positions; K/V go through the paged cache."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        rand = lambda *shape: torch.randn(*shape, generator=g) / shape[0] ** 0.5
        self.embed, self.pos = rand(VOCAB, DIM) * 6, rand(MAX_POS, DIM) * 6
        self.wq, self.wk, self.wv = rand(DIM, DIM), rand(DIM, KV_HEADS * HEAD_DIM), rand(DIM, KV_HEADS * HEAD_DIM)
        self.wo, self.head = rand(DIM, DIM), rand(DIM, VOCAB) * 4
        self.config = SimpleNamespace(vocab_size=VOCAB)

    def kv_specs(self) -> list[KVSpec]:
        return [KVSpec(((KV_HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM)))]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed[batch.input_ids] + self.pos[batch.positions]
        q = (x @ self.wq).view(-1, HEADS, HEAD_DIM)
        k_cache, v_cache = batch.kv.layers[0]
        k_cache[batch.slot_mapping] = (x @ self.wk).view(-1, KV_HEADS, HEAD_DIM)
        v_cache[batch.slot_mapping] = (x @ self.wv).view(-1, KV_HEADS, HEAD_DIM)
        attn = torch.empty_like(q)
        for i in range(batch.num_seqs):
            rows, slots = batch.seq_rows(i), batch.seq_slots(i)
            attn[rows] = _paged_attention(q[rows], k_cache[slots], v_cache[slots])
        out = x + attn.reshape(-1, DIM) @ self.wo
        return (out @ self.head)[batch.logits_rows]

    def dense_logits(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids)
        x = self.embed[ids] + self.pos[: len(ids)]
        q = (x @ self.wq).view(-1, HEADS, HEAD_DIM).transpose(0, 1)
        k = (x @ self.wk).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        v = (x @ self.wv).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(-1, DIM)
        return (x + attn @ self.wo) @ self.head


def _paged_attention(q, k, v):
    """q [n, H, D] for the last n of L cached positions; k, v [L, KVH, D]."""
    n, length = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, 1)
    v = v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / HEAD_DIM ** 0.5
    q_pos = torch.arange(length - n, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


class ByteTokenizer:
    """Token t >= 2 is one byte of a small table that includes the UTF-8 bytes of é and €."""
    TABLE = [b"<s>", b"</s>"] + [bytes([c]) for c in b" abcdefghijklmnopqrstuvwxyz.,!?"] + \
        [bytes([c]) for c in "é€".encode()] + [b"ab", b"cd", b"xyz", b"!!", b"\n", b"q", b"Z", b"Y", b"X", b"W"]

    def decode(self, ids, skip_special_tokens=True):
        parts = [self.TABLE[t] for t in ids if not (skip_special_tokens and t < 2)]
        return b"".join(parts).decode("utf-8", errors="replace")


assert len(ByteTokenizer.TABLE) == VOCAB


def make_engine(model=None, **overrides) -> LLMEngine:
    options = dict(ctx=96, kv_bytes=1 << 22, block_size=4, max_batch=3, max_step_tokens=10,
                   eos_token_ids=(EOS,))
    options.update(overrides)
    return LLMEngine(model or TinyPagedLM(), ByteTokenizer(), EngineConfig(**options))


def run_to_end(engine: LLMEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def reference_greedy(model: TinyPagedLM, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(model.dense_logits(tokens)[-1].argmax()))
    return tokens[len(prompt):]


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 30, (count,), generator=g)]


SMALL_POOL_BYTES = 24 * 4 * (2 * KV_HEADS * HEAD_DIM * 4)   # 24 blocks of 4 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("overrides", [
    dict(),                                    # chunked prefill (budget 10 tokens), batch cap 3
    dict(max_step_tokens=512, max_batch=8),    # everything in one step
    dict(kv_bytes=SMALL_POOL_BYTES),           # 24 blocks: forces preemption and recompute
    dict(prefix_caching=False, block_size=16),
])
def test_greedy_batch_matches_dense_recompute(overrides):
    model = TinyPagedLM()
    engine = make_engine(model, **overrides)
    batch = [p * 2 for p in prompts(6)]
    ids = [engine.add_request(p, GREEDY) for p in batch]
    outputs = run_to_end(engine)
    for request_id, prompt in zip(ids, batch):
        tokens = [t for out in outputs[request_id] for t in out.new_token_ids]
        assert tokens == reference_greedy(model, prompt, 12)
        assert outputs[request_id][-1].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_happens_with_a_small_pool():
    engine = make_engine(kv_bytes=SMALL_POOL_BYTES)
    for p in prompts(6):
        engine.add_request(p * 2, GREEDY)
    run_to_end(engine)
    assert engine.block_manager.num_blocks == 24
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 24


def test_shared_prefix_is_reused_and_gives_the_same_output():
    model = TinyPagedLM()
    engine = make_engine(model, max_step_tokens=64)
    prefix = prompts(1, seed=5)[0] + prompts(1, seed=6)[0]
    first = engine.add_request(prefix + [5, 6, 7], GREEDY)
    out_first = run_to_end(engine)[first]
    second = engine.add_request(prefix + [9, 9], GREEDY)
    out_second = run_to_end(engine)[second]
    assert out_first[-1].num_cached_tokens == 0
    assert out_second[-1].num_cached_tokens == (len(prefix) // 4) * 4 > 0
    tokens = [t for out in out_second for t in out.new_token_ids]
    assert tokens == reference_greedy(model, prefix + [9, 9], 12)


def test_score_matches_dense_logits():
    model = TinyPagedLM()
    engine = make_engine(model, max_step_tokens=7)
    batch = prompts(3)
    for logits, prompt in zip(engine.score(batch), batch):
        torch.testing.assert_close(logits, model.dense_logits(prompt), atol=1e-4, rtol=1e-4)
    for start in (1, 8, 12):       # inside the first chunk, at its end, inside the second
        tail = engine.score(batch[2:], start=start)[0]
        torch.testing.assert_close(tail, model.dense_logits(batch[2])[start:], atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_blocks_and_reports():
    engine = make_engine()
    keep = engine.add_request(prompts(1)[0], GREEDY)
    gone = engine.add_request(prompts(1, seed=3)[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        engine.step()
    engine.abort(gone)
    outputs = run_to_end(engine)
    assert outputs[gone][0].finished and outputs[gone][0].finish_reason == "abort"
    assert outputs[keep][-1].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_does_not_depend_on_batch_neighbours():
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    prompt = prompts(1)[0]

    def sample(neighbours: int) -> list[int]:
        engine = make_engine()
        request = engine.add_request(prompt, params)
        for p in prompts(neighbours, seed=9):
            engine.add_request(p, noise)
        return [t for out in run_to_end(engine)[request] for t in out.new_token_ids]

    assert sample(0) == sample(2)


class ScriptedModel(TinyPagedLM):
    """Emits a fixed continuation whatever the input, to test stop handling."""

    def __init__(self, script: list[int]):
        super().__init__()
        self.script = script

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        rows = []
        for i in range(batch.num_seqs):
            step = batch.context_lens[i] - SCRIPT_PROMPT_LEN
            rows.append(F.one_hot(torch.tensor(self.script[min(step, len(self.script) - 1)]), VOCAB).float())
        return torch.stack(rows)


SCRIPT_PROMPT_LEN = 3
T = {b: i for i, b in enumerate(ByteTokenizer.TABLE)}
E_ACUTE = [T[bytes([c])] for c in "é".encode()]
EURO = [T[bytes([c])] for c in "€".encode()]


def generate_scripted(script: list[int], params: SamplingParams):
    engine = make_engine(ScriptedModel(script), max_step_tokens=64)
    request = engine.add_request([T[b"a"]] * SCRIPT_PROMPT_LEN, params)
    return run_to_end(engine)[request]


def test_multibyte_characters_are_never_split():
    script = [T[b"a"], *E_ACUTE, *EURO, T[b"b"], EOS]
    outputs = generate_scripted(script, SamplingParams(temperature=0.0, max_tokens=20))
    deltas = [out.text_delta for out in outputs]
    assert "".join(deltas) == "aé€b"
    assert all("\ufffd" not in d for d in deltas)
    assert outputs[-1].finish_reason == "stop" and outputs[-1].new_token_ids == [EOS]


@pytest.mark.parametrize("stop, text", [(("b!",), "xyza"), (("!!", "zz"), "xyzab"), (("ab",), "xyz")])
def test_stop_string_is_cut_and_never_streamed(stop, text):
    script = [T[b"xyz"], T[b"a"], T[b"b"], T[b"!!"], T[b"q"], T[b"q"]]
    outputs = generate_scripted(script, SamplingParams(temperature=0.0, max_tokens=20, stop=stop))
    assert "".join(out.text_delta for out in outputs) == text
    assert outputs[-1].finish_reason == "stop"


def test_held_back_text_is_released_when_the_stop_string_does_not_come():
    script = [T[b"x"], T[b"!"], T[b"a"], T[b"b"]]
    outputs = generate_scripted(script, SamplingParams(temperature=0.0, max_tokens=4, stop=("!!",)))
    assert [out.text_delta for out in outputs] == ["x", "", "!a", "b"]
    assert outputs[-1].finish_reason == "length"


def test_stop_token_ids_and_ignore_eos():
    script = [T[b"a"], EOS, T[b"b"], T[b"c"], T[b"q"]]
    outputs = generate_scripted(script, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True,
                                                       stop_token_ids=(T[b"c"],)))
    assert "".join(out.text_delta for out in outputs) == "ab"
    assert [t for out in outputs for t in out.new_token_ids] == [T[b"a"], EOS, T[b"b"], T[b"c"]]


def test_context_limit_ends_generation_and_rejects_long_prompts():
    engine = make_engine(ctx=40)
    with pytest.raises(KtError, match="^prompt has 41 tokens, context limit is 40$"):
        engine.add_request([2] * 41, GREEDY)
    with pytest.raises(KtError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(KtError, match="outside the vocabulary"):
        engine.add_request([2, VOCAB], GREEDY)
    request = engine.add_request([2] * 35, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    outputs = run_to_end(engine)[request]
    assert sum(len(out.new_token_ids) for out in outputs) == 5
    assert outputs[-1].finish_reason == "length"


def test_requests_added_from_another_thread_are_served():
    model = TinyPagedLM()
    engine = make_engine(model)
    batch = prompts(4)
    ids = []
    adder = threading.Thread(target=lambda: ids.extend(engine.add_request(p, GREEDY) for p in batch))
    adder.start()
    adder.join()
    outputs = run_to_end(engine)
    assert [t for out in outputs[ids[2]] for t in out.new_token_ids] == reference_greedy(model, batch[2], 12)


def test_too_small_kv_budget_is_refused():
    with pytest.raises(KtError, match="raise the KV budget"):
        make_engine(kv_bytes=1000)
