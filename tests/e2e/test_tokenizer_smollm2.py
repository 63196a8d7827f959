"""The tokenizer built from the SmolLM2 GGUF metadata (offline) must reproduce the
prompt token ids llama.cpp produced, and carry the model's chat template."""

import pytest
from transformers import PreTrainedTokenizerFast

from kt_weights.checkpoint import open_checkpoint


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    try:
        with open_checkpoint(smollm2_gguf) as ckpt:
            yield ckpt.tokenizer()
    finally:
        mp.undo()


def test_is_a_fast_tokenizer_with_the_gguf_chat_template(tokenizer, smollm2_gguf):
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def test_prompts_encode_to_llamacpp_ids(tokenizer, smollm2_reference):
    assert smollm2_reference["prompts"], "reference has no prompts"
    for prompt in smollm2_reference["prompts"]:
        # the GGUF says add_bos_token = false, so encoding with special tokens adds nothing
        assert tokenizer.encode(prompt["text"]) == prompt["prompt_ids"], prompt["name"]
        assert tokenizer.encode(prompt["text"], add_special_tokens=False) == prompt["prompt_ids"]


def test_chat_template_renders_the_reference_chat_prompt(tokenizer, smollm2_reference):
    chat = next(p for p in smollm2_reference["prompts"] if p["special"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                         tokenize=False, add_generation_prompt=True)
    assert text == chat["text"]
