"""Placement through the LLM facade: options, recording and loading expert statistics,
dynamic re-placement during prefill and decode (greedy output unchanged), stats()."""

import json

import pytest
import torch

from kt_cli import LLM, SamplingParams
from kt_cli.errors import KtError
from kt_cli.placement import place

from test_llm import save_byte_tokenizer
from tiny_models import build_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog and keeps running far away ", "ab", "0123456789" * 3]
SMALL = dict(ctx=256, max_batch=4, max_step_tokens=64, kv_memory_gb=0.01)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def tiny_dir(request, tmp_path_factory):
    directory = build_tiny(request.param, tmp_path_factory.mktemp(f"placement_{request.param}"), seed=2,
                           dtype=torch.float32)
    save_byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def baseline(tiny_dir):
    llm = LLM(str(tiny_dir), **SMALL)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


def test_default_on_the_cpu_is_no_device_experts(baseline):
    _, llm = baseline
    stats = llm.stats()
    assert stats.device_experts == 0 and stats.hit_rate == 0.0
    assert "no GPU" in stats.budget
    assert stats.times.calls > 0 and stats.times.device_s >= 0 and stats.times.transfer_s > 0


@pytest.mark.parametrize("placement", [dict(gpu_experts=5), dict(gpu_experts_ratio=0.5, placement="random"),
                                       dict(gpu_experts_ratio=1.0, placement="front-loading")])
def test_static_placements_keep_greedy_output(tiny_dir, baseline, placement):
    llm = LLM(str(tiny_dir), **SMALL, **placement)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline[0]
    stats = llm.stats()
    layers, experts = llm.placement.shape
    if "gpu_experts" in placement:
        assert [s.device_experts for s in stats.layers] == [5] * layers
    else:
        assert stats.device_experts == round(placement["gpu_experts_ratio"] * layers * experts)
    assert 0.0 < stats.hit_rate <= 1.0
    assert all(s.device_experts + s.cpu_experts == experts for s in stats.layers)
    t = stats.times
    assert t.calls == sum(1 for _ in stats.layers) * t.calls // layers and t.device_s > 0
    assert 0.0 <= t.overlap_s <= t.device_s + 1e-9 and t.overlap_s <= t.cpu_s + 1e-9
    assert 0.0 <= stats.overlap_fraction <= 1.0
    assert [s.layer for s in stats.layers] == list(llm.placement.layers)
    doc = json.loads(json.dumps(stats.to_dict()))
    assert doc["device_experts"] == stats.device_experts and len(doc["layers"]) == layers


def test_dynamic_replacement_keeps_greedy_output_and_moves_experts(tiny_dir, baseline):
    llm = LLM(str(tiny_dir), **SMALL, gpu_experts=3, prefill_replace_tokens=20, decode_replace_tokens=2)
    before = llm.placement.mask.clone()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline[0]
    stats = llm.stats()
    assert stats.moves.prefill_replacements >= llm.placement.shape[0]
    assert stats.moves.experts_moved > 0 and not torch.equal(llm.placement.mask, before)
    assert stats.moves.decode_swaps > 0
    assert [s.device_experts for s in stats.layers] == [3] * llm.placement.shape[0]   # budget kept
    for block in llm.placement.blocks:
        assert sorted(block.device_experts.resident) == block.on_device.nonzero().flatten().tolist()
    llm.placement.close()


def test_prefill_replacement_picks_the_batch_top_experts(tiny_dir):
    llm = LLM(str(tiny_dir), **SMALL, gpu_experts=4, prefill_replace_tokens=10)
    prompt = llm.encode(PROMPTS[2])
    assert 10 <= len(prompt) <= SMALL["max_step_tokens"]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    counts = llm.placement.counts()          # that one prefill batch: the only forward
    assert int(counts[0].sum()) == len(prompt) * llm.model.config.moe.top_k
    for row, block in enumerate(llm.placement.blocks):
        top = torch.sort(-counts[row].double(), stable=True).indices[:4]
        expected = torch.zeros_like(block.on_device)
        expected[top] = True
        assert torch.equal(block.on_device, expected), f"layer {llm.placement.layers[row]}"
    assert llm.stats().moves.prefill_replacements == len(llm.placement.blocks)


def test_recorded_stats_drive_frequency_placement(tiny_dir, tmp_path):
    path = tmp_path / "stats.json"
    recorder = LLM(str(tiny_dir), **SMALL, record_expert_stats=str(path))
    outs = recorder.generate(PROMPTS, GREEDY)
    assert not path.exists()                  # first periodic write after 30 s
    recorder.placement.close()                # the final write (also run at exit)
    doc = json.loads(path.read_text())
    top_k = recorder.model.config.moe.top_k
    tokens = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
    assert doc["model"] == f"{recorder.model.config.architecture}:{tiny_dir.name}"
    assert doc["layers"] == list(recorder.placement.layers)
    assert all(sum(row) == tokens * top_k for row in doc["counts"])

    llm = LLM(str(tiny_dir), **SMALL, placement="frequency", expert_stats=str(path), gpu_experts=4)
    counts = torch.tensor(doc["counts"])
    assert torch.equal(llm.placement.mask, place("frequency", 4 * counts.shape[0], counts.shape, counts))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in outs]
    assert llm.stats().hit_rate > 4 / counts.shape[1]     # hot experts beat a uniform share


def test_stats_are_written_periodically_while_the_engine_runs(tiny_dir, tmp_path):
    """The periodic write fires from engine steps (which call model.forward), not only at close."""
    path = tmp_path / "periodic.json"
    llm = LLM(str(tiny_dir), **SMALL, record_expert_stats=str(path))
    llm.placement.record_to(path, interval_s=1e-6)      # the same recorder, a tiny interval
    outs = llm.generate(PROMPTS, GREEDY)
    assert path.exists()
    tokens = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
    top_k = llm.model.config.moe.top_k
    assert all(sum(row) == tokens * top_k for row in json.loads(path.read_text())["counts"])
    llm.placement.close()


def test_bad_stats_files_are_refused_in_one_line(tiny_dir, tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": "kt-expert-stats", "version": 1, "model": "someone-else",
                                "layers": [0], "num_experts": 2, "counts": [[1, 2]]}))
    with pytest.raises(KtError, match="recorded for model 'someone-else'") as err:
        LLM(str(tiny_dir), **SMALL, placement="frequency", expert_stats=str(path), gpu_experts=2)
    assert "\n" not in str(err.value)
    with pytest.raises(KtError, match="frequency placement needs expert statistics"):
        LLM(str(tiny_dir), **SMALL, placement="frequency")
    with pytest.raises(KtError, match="unknown placement 'hottest'"):
        LLM(str(tiny_dir), **SMALL, placement="hottest")


def test_cuda_placement_keeps_greedy_output(tiny_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    on_cuda = dict(SMALL, device="cuda", dtype=torch.float32)
    cpu_experts = LLM(str(tiny_dir), **on_cuda, gpu_experts=0)
    want = [o.token_ids for o in cpu_experts.generate(PROMPTS, GREEDY)]
    auto = LLM(str(tiny_dir), **on_cuda)
    assert "auto" in auto.stats().budget and auto.stats().device_experts == auto.placement.shape[0] * \
        auto.placement.shape[1]                                  # tiny experts: all fit
    assert [o.token_ids for o in auto.generate(PROMPTS, GREEDY)] == want
    llm = LLM(str(tiny_dir), **on_cuda, gpu_experts=4, prefill_replace_tokens=20, decode_replace_tokens=2)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    stats = llm.stats()
    assert stats.times.device_s > 0 and stats.moves.experts_moved > 0
    assert all(t.is_cuda for b in llm.placement.blocks for ts in b.device_experts.resident.values() for t in ts)
    llm.placement.close()
