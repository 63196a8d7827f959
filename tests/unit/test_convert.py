"""kt convert on checkpoints written directly with safetensors: every converted
matrix against independent references (kt's torch quantize_reference, an
independent FP8 tile loop, gguf's own quantize/dequantize and GGUFReader),
bounded peak memory in a subprocess, kill + --resume giving identical bytes,
and bad input refused with one-line errors and no output."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from convert_fixtures import fp8_reference, qwen3_config, write_checkpoint
from kt_weights.checkpoint import open_checkpoint
from kt_weights.convert import ConvertOptions, convert, summary_table_rows
from kt_weights.errors import WeightsError
from kt_weights.layout import Format, quantize_reference

SMALL = qwen3_config(layers=2, hidden=128, experts=4, inter=64, vocab=96)


def run_cli(*args) -> subprocess.CompletedProcess:
    """The argparse entry point, in process (same code path as `python -m kt_weights.convert`)."""
    import contextlib
    import io

    from kt_weights.convert.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "small", SMALL, seed=1)


def source_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


@pytest.mark.parametrize("to,fmt", [("int8", Format.I8), ("int4", Format.I4)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_every_matrix_equals_the_reference_quantizer(small, tmp_path, to, fmt, symmetric):
    summary = convert(ConvertOptions(str(small), tmp_path / "out", to, group_size=32, symmetric=symmetric))
    src = source_tensors(small)
    with open_checkpoint(tmp_path / "out") as ckpt:
        assert ckpt.architecture == "Qwen3MoeForCausalLM" and set(ckpt.names()) == set(src)
        for name, w in src.items():
            if name.endswith("_proj.weight"):
                got, ref = ckpt.matrix(name), quantize_reference(w.float(), fmt, 32, symmetric)
                assert got.format == fmt and got.group == 32
                assert torch.equal(got.data, ref.data) and torch.equal(got.scale, ref.scale), name
                assert (got.min is None) == symmetric
            else:
                assert torch.equal(ckpt.tensor(name), w.float()), name
        assert len(ckpt.experts(1, "down")) == 4
    # worst case per group, relative to the group's |max|: half a step (int8; asymmetric int4: step =
    # range/15 <= 2|max|/15), a full step for symmetric int4 (+|max| clamps at q=7, step = |max|/8)
    bound = {(Format.I8, True): 1 / 254, (Format.I8, False): 1 / 255, (Format.I4, True): 1 / 8,
             (Format.I4, False): 1 / 15}[fmt, symmetric]
    assert 0 < summary.max_rel_error["experts"] <= bound * (1 + 1e-5)
    assert set(summary.max_rel_error) >= {"q", "k", "v", "o", "experts"}


def test_matrices_are_zero_copy_views_of_the_file(small, tmp_path):
    convert(ConvertOptions(str(small), tmp_path / "out", "int4", group_size=64))
    with open_checkpoint(tmp_path / "out") as ckpt:
        m = ckpt.experts(0, "gate")[0]
        f = ckpt._matrices["model.layers.0.mlp.experts.0.gate_proj.weight"][0]
        base = f._bytes.ctypes.data
        assert base <= m.data.data_ptr() < base + len(f._bytes)
        assert base <= m.scale.data_ptr() < base + len(f._bytes)


def test_bf16_and_experts_only(small, tmp_path):
    convert(ConvertOptions(str(small), tmp_path / "bf16", "bf16"))
    convert(ConvertOptions(str(small), tmp_path / "eo", "int8", experts_only=True))
    src = source_tensors(small)
    with open_checkpoint(tmp_path / "bf16") as a, open_checkpoint(tmp_path / "eo") as b:
        for name, w in src.items():
            assert torch.equal(a.tensor(name), w.float())
            if ".experts." not in name:
                assert torch.equal(b.tensor(name), w.float()), name
        assert b.experts(1, "up")[0].format == Format.I8


@pytest.mark.parametrize("mode", ["block", "channel"])
def test_fp8_sources_dequantize_like_an_independent_loop(tmp_path, mode):
    config = qwen3_config(layers=1, hidden=160, experts=2, inter=288, vocab=64)   # partial 128-blocks
    src = write_checkpoint(tmp_path / "fp8", config, seed=2, fp8=mode)
    convert(ConvertOptions(str(src), tmp_path / "out", "bf16"))
    raw = source_tensors(src)
    with open_checkpoint(tmp_path / "out") as ckpt:
        for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight"):
            q = raw[name]
            assert q.dtype == torch.float8_e4m3fn
            ref = fp8_reference(q, raw[name + "_scale_inv"]) if mode == "block" else \
                q.float() * raw[name[:-len("weight")] + "weight_scale"]
            torch.testing.assert_close(ckpt.tensor(name), ref.bfloat16().float(), rtol=0, atol=0)


def test_manifest_checksums_and_format_tag(small, tmp_path):
    convert(ConvertOptions(str(small), tmp_path / "out", "int8"))
    meta = json.loads((tmp_path / "out" / "kt_format.json").read_text())
    assert (meta["layout"], meta["version"], meta["format"]) == ("kt-q1", 1, "int8")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())["files"]
    assert set(manifest) >= {"config.json", "kt_format.json", "globals.safetensors",
                             "layers/layer-00000.safetensors", "layers/layer-00001.safetensors"}
    import hashlib
    for rel, entry in manifest.items():
        data = (tmp_path / "out" / rel).read_bytes()
        assert len(data) == entry["size"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert not list(tmp_path.glob("*partial*"))


def test_refuses_to_overwrite_without_force(small, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    r = run_cli(small, tmp_path / "out", "--to", "int8")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "--force" in r.stderr
    assert (tmp_path / "out" / "keep").exists()
    assert run_cli(small, tmp_path / "out", "--to", "int8", "--force").returncode == 0
    assert not (tmp_path / "out" / "keep").exists() and (tmp_path / "out" / "kt_format.json").exists()


# ---- GGUF ---------------------------------------------------------------------------

@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_0", "q4_1", "f16"])
def test_gguf_reads_back_with_ggufs_reader_and_kts(small, tmp_path, gguf_type):
    dst = tmp_path / "m.gguf"
    r = run_cli(small, dst, "--to", "gguf", "--gguf-type", gguf_type, "--json")
    assert r.returncode == 0, r.stderr
    qtype = gguf.GGMLQuantizationType[gguf_type.upper()]
    reader = gguf.GGUFReader(dst)
    fields = {f.name: f for f in reader.fields.values()}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "qwen3moe"
    tensors = {t.name: t for t in reader.tensors}
    exps = tensors["blk.1.ffn_down_exps.weight"]
    assert exps.tensor_type == qtype and list(exps.shape) == [64, 128, 4]     # ne order
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.attn_q_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    src = source_tensors(small)
    stacked = np.stack([src[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].float().numpy() for e in range(4)])
    expected = gguf.quants.dequantize(gguf.quants.quantize(stacked, qtype), qtype) if gguf_type != "f16" \
        else stacked.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(gguf.quants.dequantize(exps.data, qtype).reshape(stacked.shape), expected)
    with open_checkpoint(dst) as ckpt:
        assert ckpt.architecture == "Qwen3MoeForCausalLM" and set(ckpt.names()) == set(src)
        for e, m in enumerate(ckpt.experts(1, "down")):
            np.testing.assert_array_equal(m.dequantize().numpy(), expected[e])
        assert ckpt.config["head_dim"] == 32 and ckpt.config["num_experts"] == 4


class StopAfter:
    """A progress sink that interrupts the run (as Ctrl-C would) after n units."""

    def __init__(self, n: int) -> None:
        self.n = n

    def start(self, info) -> None:
        pass

    def unit_done(self, unit) -> None:
        if unit.index + 1 >= self.n:
            raise KeyboardInterrupt


def test_gguf_resume_after_interrupt_gives_identical_bytes(small, tmp_path):
    full = tmp_path / "full.gguf"
    assert run_cli(small, full, "--to", "gguf").returncode == 0
    part = tmp_path / "part.gguf"
    with pytest.raises(KeyboardInterrupt):
        convert(ConvertOptions(str(small), part, "gguf"), StopAfter(2))
    assert not part.exists() and (tmp_path / "part.gguf.partial").exists()
    r = run_cli(small, part, "--to", "gguf")
    assert r.returncode == 2 and "--resume" in r.stderr
    with open(tmp_path / "part.gguf.partial", "r+b") as f:      # a torn write after the last journaled unit
        f.seek(0, 2)
        f.write(b"torn" * 1000)
    r = run_cli(small, part, "--to", "gguf", "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed_units"] == 2
    assert part.read_bytes() == full.read_bytes()


# ---- bad input ------------------------------------------------------------------------

def broken(tmp_path: Path, small: Path, how: str) -> Path:
    import shutil
    d = tmp_path / how
    shutil.copytree(small, d)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    if how == "no_config":
        (d / "config.json").unlink()
    elif how == "missing_shard":
        shard.unlink()
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "corrupt_header":
        data = bytearray(shard.read_bytes())
        data[8:20] = b"garbage{{{{{"
        shard.write_bytes(bytes(data))
    elif how == "unknown_arch":
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(dict(cfg, architectures=["FooForCausalLM"])))
    elif how == "int_dtype":
        from safetensors.torch import save_file
        with safe_open(shard, "pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 128, dtype=torch.int32)
        save_file(tensors, shard)
    return d


BAD_INPUTS = [("no_config", "missing config.json"), ("missing_shard", "missing shard"),
              ("truncated", "truncated"), ("corrupt_header", "not valid JSON"),
              ("unknown_arch", "unsupported architecture FooForCausalLM"), ("int_dtype", "dtype I32")]


@pytest.mark.parametrize("how,message,to", [(h, m, "int4") for h, m in BAD_INPUTS] +
                         [(h, m, "gguf") for h, m in BAD_INPUTS if h in ("truncated", "int_dtype")])
def test_bad_input_is_one_line_and_leaves_nothing(small, tmp_path, how, message, to):
    src = broken(tmp_path, small, how)
    dst = tmp_path / ("out.gguf" if to == "gguf" else "out")
    r = run_cli(src, dst, "--to", to)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [how]


def test_full_disk_is_refused_before_writing(small, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 20, 10 << 20, 1 << 20))
    with pytest.raises(WeightsError, match=r"not enough free disk: the output needs about .* MB, 1\.0 MB are free"):
        convert(ConvertOptions(str(small), tmp_path / "out", "int8"))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kwargs,message", [
    (dict(to="int3"), "--to must be one of"), (dict(to="int4", group_size=48), "--group-size"),
    (dict(to="int8", gguf_type="q8_0"), "--gguf-type only applies"), (dict(to="gguf", gguf_type="q2_k"), "--gguf-type"),
    (dict(to="gguf", destination="out"), "ending in .gguf"), (dict(to="int8", threads=0), "--threads")])
def test_options_are_validated(kwargs, message):
    kwargs = {"source": "x", "destination": "out.gguf", **kwargs}
    with pytest.raises(WeightsError, match=message):
        ConvertOptions(**kwargs)


def test_summary_rows(small, tmp_path):
    summary = convert(ConvertOptions(str(small), tmp_path / "out", "int4"))
    rows = dict(summary_table_rows(summary))
    assert rows["format"] == "int4" and "MB/s" in rows["throughput"] and "max rel error experts" in rows
    assert summary.output_bytes < summary.source_bytes / 2     # embeddings, lm_head, norms stay BF16


# ---- memory and resume on a model bigger than the memory budget -----------------------

BIG = qwen3_config(layers=16, hidden=384, experts=32, inter=192, vocab=256)
LAYER_BYTES = 3 * 32 * 384 * 192 * 2 + 4 * 384 * 384 * 2


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("big") / "src", BIG, seed=3)


def peak_rss_of(*args) -> int:
    """Peak RSS (bytes) of `python -m kt_weights.convert args`, measured by a fresh
    wrapper process so that no parent memory is counted."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss if r.returncode == 0 else -1)")
    out = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "kt_weights.convert", *map(str, args)],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip()) * 1024


@pytest.mark.slow
def test_peak_memory_stays_within_two_layers_of_baseline(big, tmp_path):
    model_bytes = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    one_layer = write_checkpoint(tmp_path / "one", dict(BIG, num_hidden_layers=1), seed=4)
    baseline = peak_rss_of(one_layer, tmp_path / "one_out", "--to", "int8")
    peak = peak_rss_of(big, tmp_path / "big_out", "--to", "int8")
    assert baseline > 0 and peak > 0
    budget = baseline + 2 * LAYER_BYTES
    print(f"model {model_bytes / 1e6:.0f} MB, baseline {baseline / 1e6:.0f} MB, peak {peak / 1e6:.0f} MB, "
          f"budget {budget / 1e6:.0f} MB")
    assert model_bytes > 6 * LAYER_BYTES * 2 and peak < budget


def test_reported_peak_is_the_converters_own_not_its_parents(small, tmp_path):
    """A parent that once held 1.5 GB starts the converter: Linux carries ru_maxrss over
    fork and exec, so a peak taken from it would read >= 1.5 GB for a conversion that
    never came near that; the fresh-wrapper measure above is the independent figure."""
    held = 1_500_000_000
    code = ("import json, subprocess, sys; x = bytearray(%d); x[::4096] = b'1' * len(x[::4096]); "
            "r = subprocess.run(sys.argv[1:], capture_output=True, text=True, check=True); "
            "print(json.loads(r.stdout)['peak_rss_bytes'])" % held)
    out = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "kt_weights.convert", str(small),
                          str(tmp_path / "out"), "--to", "int8", "--json"], capture_output=True, text=True, check=True)
    reported = int(out.stdout.strip())
    independent = peak_rss_of(small, tmp_path / "out2", "--to", "int8")
    assert reported < held / 2 and abs(reported - independent) < 0.25 * independent


@pytest.mark.slow
def test_kill_and_resume_gives_identical_files(big, tmp_path):
    full = tmp_path / "full"
    assert run_cli(big, full, "--to", "int4").returncode == 0
    part = tmp_path / "part"
    journal = tmp_path / "part.kt-partial" / "journal.json"
    proc = subprocess.Popen([sys.executable, "-m", "kt_weights.convert", big, part, "--to", "int4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if journal.exists() and len(json.loads(journal.read_text() or "{}").get("units", {})) >= 4:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "conversion finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not part.exists()
    r = run_cli(big, part, "--to", "int4", "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed_units"] >= 4
    manifest = json.loads((part / "manifest.json").read_text())
    assert manifest == json.loads((full / "manifest.json").read_text())
