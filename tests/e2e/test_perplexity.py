"""SmolLM2-135M Q4_1 (the default model) against llama.cpp: perplexity on KJV Genesis 1-10
with llama-perplexity's rule, teacher-forced agreement with llama.cpp's greedy tokens, and
the chat prompt built from the GGUF's template.

Bounds: llama.cpp multiplies Q4_1 weights by 8-bit-quantized activations; transformers in
float32 on the dequantized weights scores 7.1804 against llama.cpp's 7.2081 (0.4% apart),
so an engine computing close to either lands within 1%. Greedy top-1: >= 95% of steps."""

import json
import math

import pytest
import torch

from kt_cli import LLM, SamplingParams
from kt_cli.errors import KtError
from kt_cli.eval import perplexity, second_half_nll

PPL_TOLERANCE = 0.01
TOP1_AGREEMENT = 0.95


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return LLM(str(smollm2_gguf), ctx=512, max_batch=1, kv_memory_gb=0.05)


@pytest.fixture(scope="module")
def ppl_reference(reference_dir) -> dict:
    return json.loads((reference_dir / "smollm2_llamacpp_perplexity.json").read_text())


@pytest.mark.slow
def test_perplexity_matches_llamacpp(smollm2, reference_dir, ppl_reference):
    text = (reference_dir / "kjv_genesis_1-10.txt").read_text()
    result = perplexity(smollm2, text, ctx=ppl_reference["n_ctx"])
    assert result.n_tokens == ppl_reference["n_tokens"]
    assert result.n_chunks == ppl_reference["n_chunks"]
    assert result.n_scored == ppl_reference["n_chunks"] * ppl_reference["scored_tokens_per_chunk"]
    want = ppl_reference["ppl"]
    assert abs(result.ppl / want - 1) < PPL_TOLERANCE, f"kt {result.ppl:.4f} vs llama.cpp {want}"
    json.dumps(result.to_dict())


@pytest.mark.slow
def test_teacher_forced_top1_agrees_with_llamacpp_greedy(smollm2, smollm2_reference):
    agree = total = 0
    for prompt in smollm2_reference["prompts"]:
        ids = prompt["prompt_ids"] + prompt["greedy_ids"][:-1]
        logits = smollm2.logits([ids], start=prompt["n_prompt"] - 1)[0]   # predicts each greedy token
        agree += (logits.argmax(-1) == torch.tensor(prompt["greedy_ids"])).sum().item()
        total += len(prompt["greedy_ids"])
    assert agree / total >= TOP1_AGREEMENT, f"top-1 agreement {agree}/{total}"


def test_second_half_rule_scores_tokens_after_the_midpoint():
    """ctx 8: logits rows for positions 4..7 are handed in; positions 4, 5, 6 predict tokens 5, 6, 7."""
    chunk = [0, 1, 2, 3, 4, 5, 6, 7]
    logits = torch.full((4, 10), -30.0)
    logits[0, 5] = logits[1, 6] = logits[2, 7] = 30.0
    logits[3, 0] = 30.0            # position 7 predicts past the chunk: never scored
    nll = second_half_nll(logits, chunk)
    assert nll.shape == (3,) and nll.max().item() < 1e-10
    logits[1, 6] = -30.0
    assert math.isclose(second_half_nll(logits, chunk)[1].item(), math.log(10), rel_tol=1e-9)   # row 1 now uniform


@pytest.mark.slow
def test_chat_prompt_and_answer(smollm2, smollm2_reference):
    chat = next(p for p in smollm2_reference["prompts"] if p["name"] == "chat_2plus2")
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert smollm2.chat_prompt(messages) == chat["prompt_ids"]
    out = smollm2.chat(messages, SamplingParams(temperature=0.0, max_tokens=32))
    assert out.finish_reason == "stop" and out.token_ids[-1] == smollm2_reference["eos_id"]
    assert "4" in out.text and "<|im_end|>" not in out.text


class UniformLLM:
    """Logits that give every token of a 10-token vocabulary probability 1/10."""
    ctx = 64

    class tokenizer:
        add_bos_token = False

        @staticmethod
        def encode(text, add_special_tokens=False):
            return [int(c) for c in text]

    def logits(self, token_lists, start=0):
        return [torch.zeros(len(ids) - start, 10) for ids in token_lists]


def test_chunking_and_max_chunks():
    text = "0123456789" * 10                     # 100 tokens: 6 chunks of 16, 4 left over
    result = perplexity(UniformLLM(), text, ctx=16)
    assert (result.n_tokens, result.n_chunks, result.n_scored) == (100, 6, 6 * 7)
    assert math.isclose(result.ppl, 10.0, rel_tol=1e-12)
    assert perplexity(UniformLLM(), text, ctx=16, max_chunks=2).n_scored == 14
    with pytest.raises(KtError, match="fewer than one"):
        perplexity(UniformLLM(), "0123", ctx=16)
