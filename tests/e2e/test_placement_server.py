"""`kt run` (the server) with expert placement: options parsed and validated, the startup
summary names the split, /metrics carries the placement gauges."""

import re

import pytest
import torch

from kt_cli.server.__main__ import parser
from kt_cli.server.launch import load, summary_rows
from kt_cli.server.options import ServeOptions, ServeOptionsError

from test_llm import save_byte_tokenizer
from tiny_models import build_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = build_tiny("qwen3_moe", tmp_path_factory.mktemp("placement_server"), dtype=torch.float32)
    save_byte_tokenizer(directory)
    return directory


def test_cli_flags_reach_the_options(tmp_path):
    args = vars(parser().parse_args(["--model", "m", "--gpu-experts", "3", "--placement", "front-loading",
                                     "--record-expert-stats", str(tmp_path / "s.json"),
                                     "--prefill-replace-tokens", "128"]))
    options = ServeOptions(**args)
    assert options.placement_options()["gpu_experts"] == 3
    assert options.placement_options()["placement"] == "front-loading"
    assert options.placement_options()["prefill_replace_tokens"] == 128


def test_bad_placement_options_are_refused():
    with pytest.raises(ServeOptionsError, match="not both"):
        ServeOptions(model="m", gpu_experts=2, gpu_experts_ratio=0.5)
    with pytest.raises(ServeOptionsError, match="frequency placement needs expert statistics"):
        ServeOptions(model="m", placement="frequency")


def test_summary_and_metrics_show_the_placement(tiny_dir, tmp_path):
    server = load(ServeOptions(model=str(tiny_dir), gpu_experts=6, ctx=128, kv_memory_gb=0.01,
                               record_expert_stats=tmp_path / "s.json"))
    try:
        rows = dict(summary_rows(server))
        assert rows["experts"].startswith("12 of 32 routed experts on the device (uniform; 6 per MoE layer")
        server.llm.generate(["hello there"])
        text = server.state.metrics.render()
    finally:
        server.state.on_shutdown()
    assert 'kt_experts_on_device{layer="0"} 6' in text and 'kt_experts_on_cpu{layer="1"} 10' in text
    hit = float(re.search(r"^kt_expert_device_hit_rate (\S+)$", text, re.M).group(1))
    assert 0.0 < hit < 1.0
    for part in ("cpu_experts", "cpu_wait", "device", "transfer", "overlap"):
        assert f'kt_moe_seconds_total{{part="{part}"}}' in text
    assert "# TYPE kt_expert_layer_hit_rate gauge" in text
