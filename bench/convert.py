"""Conversion throughput (MB/s of source read) and peak RSS vs model size, per
output format, on a random Qwen3-MoE-layout checkpoint written to a temp dir.

  python bench/convert.py [--layers 8] [--hidden 512] [--experts 32] [--inter 256]
                          [--formats int8,int4,bf16,gguf-q8_0,gguf-q4_0]
Each conversion runs in a fresh subprocess; peak RSS is its ru_maxrss."""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
from convert_fixtures import qwen3_config, write_checkpoint  # noqa: E402

_WRAPPER = ("import json, resource, subprocess, sys; "
            "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(json.dumps({'rc': r.returncode, 'out': r.stdout, 'err': r.stderr[-400:], "
            "'rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))")


def run(src: Path, dst: Path, fmt: str) -> dict:
    to, _, gguf_type = fmt.partition("-")
    args = [sys.executable, "-m", "kt_weights.convert", str(src), str(dst), "--to", to, "--json", "--force"]
    if gguf_type:
        args += ["--gguf-type", gguf_type]
    result = json.loads(subprocess.run([sys.executable, "-c", _WRAPPER, *args], capture_output=True,
                                       text=True, check=True).stdout)
    if result["rc"] != 0:
        raise SystemExit(f"{fmt}: {result['err']}")
    return dict(json.loads(result["out"]), child_peak_rss=result["rss"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--formats", default="int8,int4,bf16,gguf-q8_0,gguf-q4_0")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = write_checkpoint(Path(tmp) / "src", qwen3_config(a.layers, a.hidden, a.experts, a.inter, vocab=1024))
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        print(f"model: {a.layers} layers, {size / 1e6:.0f} MB bf16")
        print(f"{'format':12} {'MB/s read':>10} {'seconds':>8} {'out MB':>8} {'peak RSS MB':>12} {'RSS/model':>10}")
        for fmt in a.formats.split(","):
            dst = Path(tmp) / ("out.gguf" if fmt.startswith("gguf") else f"out-{fmt}")
            s = run(src, dst, fmt)
            print(f"{fmt:12} {s['read_mb_per_s']:10.1f} {s['seconds']:8.1f} {s['output_bytes'] / 1e6:8.1f} "
                  f"{s['child_peak_rss'] / 1e6:12.0f} {s['child_peak_rss'] / size:10.2f}")


if __name__ == "__main__":
    main()
