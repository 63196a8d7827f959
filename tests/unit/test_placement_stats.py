"""Expert-statistics files: round trip in both formats, atomic writes, validation errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from kt_cli.placement import ExpertStats, PlacementError, load

COUNTS = torch.tensor([[3, 0, 7, 1], [0, 0, 2, 9]], dtype=torch.int64)


def stats() -> ExpertStats:
    return ExpertStats("Qwen3MoeForCausalLM:tiny", (1, 3), COUNTS)


@pytest.mark.parametrize("name", ["s.json", "s.safetensors"])
def test_round_trip(tmp_path, name):
    path = stats().save(tmp_path / name)
    back = load(path)
    assert back.model == "Qwen3MoeForCausalLM:tiny" and back.layers == (1, 3)
    assert back.counts.dtype == torch.int64 and torch.equal(back.counts, COUNTS)
    assert [p.name for p in tmp_path.iterdir()] == [name]      # no temporary file left behind


def test_save_replaces_an_existing_file_whole(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("old and longer than the new document " * 100)
    stats().save(path)
    assert json.loads(path.read_text())["counts"] == COUNTS.tolist()


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = stats().save(tmp_path / "s.json")
    monkeypatch.setattr("kt_cli.placement.stats.json.dumps", lambda *_: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        ExpertStats("other", (1, 3), COUNTS * 2).save(path)
    assert load(path).model == "Qwen3MoeForCausalLM:tiny"
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_check_matches_model_and_shape():
    s = stats()
    s.check_matches("Qwen3MoeForCausalLM:tiny", (1, 3), 4)
    with pytest.raises(PlacementError, match="recorded for model 'Qwen3MoeForCausalLM:tiny', this model is 'x'"):
        s.check_matches("x", (1, 3), 4)
    with pytest.raises(PlacementError, match=r"shape 2x4 on layers \[1, 3\], the model has 2x8"):
        s.check_matches("Qwen3MoeForCausalLM:tiny", (1, 3), 8)
    with pytest.raises(PlacementError, match="the model has 3x4 on layers"):
        s.check_matches("Qwen3MoeForCausalLM:tiny", (1, 2, 3), 4)


def good_doc() -> dict:
    return {"format": "kt-expert-stats", "version": 1, "model": "m", "layers": [0, 1], "num_experts": 2,
            "counts": [[1, 2], [3, 4]]}


@pytest.mark.parametrize("change, message", [
    (dict(format="other"), "format tag is 'other'"),
    (dict(version=2), "format version 2 unsupported"),
    (dict(model=""), "names no model"),
    (dict(layers=[0]), "2 layers but 1 layer ids"),
    (dict(layers="0,1"), "'layers' must be a list"),
    (dict(counts=[[1, 2], [3]]), "rows must all have num_experts=2"),
    (dict(num_experts=3), "rows must all have num_experts=3"),
    (dict(counts=[[1, -2], [3, 4]]), "must be >= 0"),
    (dict(counts=[[1, 2.5], [3, 4]]), "finite whole numbers"),
    (dict(counts=[[1, "a"], [3, 4]]), "numbers only"),
    (dict(counts=[[1, float("nan")], [3, 4]]), "numbers only"),
])
def test_bad_json_files_give_one_line_errors(tmp_path, change, message):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(dict(good_doc(), **change)))
    with pytest.raises(PlacementError, match=message) as err:
        load(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(PlacementError, match="no such file"):
        load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlacementError, match="not valid JSON"):
        load(tmp_path / "bad.json")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(PlacementError, match="not a readable safetensors file"):
        load(tmp_path / "bad.safetensors")


def test_bad_safetensors_files(tmp_path):
    path = tmp_path / "s.safetensors"
    layers = torch.tensor([0, 1])
    save_file({"counts": COUNTS, "layers": layers}, path, metadata={"format": "kt-expert-stats", "version": "1"})
    with pytest.raises(PlacementError, match="names no model"):
        load(path)
    save_file({"counts": COUNTS.float() - 5, "layers": layers}, path,
              metadata={"format": "kt-expert-stats", "version": "1", "model": "m"})
    with pytest.raises(PlacementError, match=">= 0"):
        load(path)
    save_file({"counts": COUNTS, "layers": layers, "extra": layers.clone()}, path,
              metadata={"format": "kt-expert-stats", "version": "1", "model": "m"})
    with pytest.raises(PlacementError, match="expected tensors 'counts' and 'layers'"):
        load(path)
