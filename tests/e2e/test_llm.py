"""kt_cli.LLM end to end on a tiny random Llama saved by transformers (plus a byte-level
tokenizer), against transformers' own greedy generate and forward pass."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kt_cli import LLM, SamplingParams
from kt_cli.errors import KtError

from tiny_models import build_tiny, reference_model

EOS = 2
PROMPTS = ["Hello there, ", "a", "The quick brown fox jumps over the lazy dog and keeps running ",
           "ünïcödé €uro ", "0123456789" * 4]


def save_byte_tokenizer(directory) -> None:
    """256 single-byte tokens, no merges: exactly the tiny model's vocabulary."""
    to_unicode = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={to_unicode[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=to_unicode[1], eos_token=to_unicode[EOS])
    fast.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = build_tiny("llama", tmp_path_factory.mktemp("llm_llama"), seed=3)
    save_byte_tokenizer(directory)
    return directory, reference_model(directory)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), ctx=256, max_batch=4, max_step_tokens=24, kv_memory_gb=0.01)


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_batch_equals_transformers_generate(tiny_llama, llm):
    _, ref = tiny_llama
    params = SamplingParams(temperature=0.0, max_tokens=20)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        want = hf_greedy(ref, llm.encode(prompt), 20)
        assert out.token_ids == want, prompt
        assert out.finish_reason == ("stop" if want[-1] == EOS else "length")
        assert out.text == llm.tokenizer.decode(want, skip_special_tokens=True)


def test_greedy_steps_take_their_tokens_from_the_native_head(tiny_llama, llm, monkeypatch):
    """Greedy rows without penalties get the head's argmax (the sampler is not asked); a
    penalty sends the step back to the logits and the sampler. Both give transformers' tokens."""
    _, ref = tiny_llama
    head_calls, sampler_calls = [], []
    head, sampler = type(llm.engine.runner.model.decode_head), type(llm.engine.runner.sampler)
    monkeypatch.setattr(head, "__call__", lambda self, h, argmax, f=head.__call__:
                        head_calls.append(argmax) or f(self, h, argmax))
    monkeypatch.setattr(sampler, "__call__", lambda self, logits, rows, f=sampler.__call__:
                        sampler_calls.append(1) or f(self, logits, rows))
    prompt = PROMPTS[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert greedy.token_ids == hf_greedy(ref, llm.encode(prompt), 8)
    assert head_calls.count(True) == 8 and not sampler_calls      # prompt chunks that do not sample: False
    head_calls.clear()
    penalised = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.0001)
    llm.generate([prompt], penalised)
    assert head_calls and True not in head_calls and len(sampler_calls) == 8


def test_shared_prefix_reports_cached_tokens_and_same_output(tiny_llama, llm):
    _, ref = tiny_llama
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prefix = "In the beginning there was a long shared system prompt. " * 2
    first = llm.generate([prefix + "First?"], params)[0]
    second = llm.generate([prefix + "Second!"], params)[0]
    shared = len(llm.encode(prefix))
    assert first.num_cached_tokens < 16 and second.num_cached_tokens == shared // 16 * 16
    want = ref.generate(torch.tensor([second.prompt_token_ids]), max_new_tokens=12, do_sample=False,
                        min_new_tokens=12, pad_token_id=0)[0, second.num_prompt_tokens:].tolist()
    assert second.token_ids == want


def test_logits_equal_transformers_forward(tiny_llama, llm):
    _, ref = tiny_llama
    batch = [llm.encode(p) for p in PROMPTS[2:]]
    for got, ids in zip(llm.logits(batch), batch):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([ids])).logits[0]
        assert got.shape == want.shape
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_chat_uses_the_template_with_a_generation_prompt(llm):
    messages = [{"role": "user", "content": "hi"}]
    assert llm.tokenizer.decode(llm.chat_prompt(messages)) == "<user>hi\n<assistant>"
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stream_yields_deltas_that_add_up(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    deltas = list(llm.stream("Hello there, ", params))
    whole = llm.generate(["Hello there, "], params)[0]
    assert [t for d in deltas for t in d.new_token_ids] == whole.token_ids
    assert "".join(d.text_delta for d in deltas) == whole.text
    assert deltas[-1].finished and not llm.engine.has_unfinished()


def test_bad_input_gives_one_line_errors(tiny_llama, llm):
    with pytest.raises(KtError, match="^prompt has 300 tokens, context limit is 256$"):
        llm.generate([[5] * 300])
    with pytest.raises(KtError, match="unknown LLM option 'contex'"):
        LLM(str(tiny_llama[0]), contex=5)
    with pytest.raises(KtError, match="2 prompts but 1 sampling"):
        llm.generate(["a", "b"], [SamplingParams()])
