"""The scaled Qwen3-MoE of ../shared/reference/llamacpp_bench.json (8 layers, hidden 2048,
128 experts, top-8, moe_intermediate 768, 32/4 heads of 128, SmolLM2's 49152-token
vocabulary; ~5.2 B random parameters), built once in bounded memory (one safetensors shard
per layer) and converted with `kt convert` to the GGUF types asked for. Prints the paths. K-quant mixes
(q4_k_m, q5_k_m), which kt does not write, are quantized from the BF16 GGUF by llama.cpp itself
(llama_model_quantize, through an interpreter with llama-cpp-python: --llama-cpp), as the
reference files of llamacpp_bench.json were by llama-quantize.

    python bench/scaled_model.py [--types q4_0 q8_0 q4_k_m] [--dir ~/.cache/kt/bench/qwen3moe-8L]
                                 [--llama-cpp OTHER_PYTHON]
"""

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
from convert_fixtures import qwen3_config, write_checkpoint  # noqa: E402

from kt_cli import hardware, store  # noqa: E402
from kt_weights.checkpoint import open_checkpoint  # noqa: E402

LLAMACPP_SHAPE = dict(layers=8, hidden=2048, experts=128, inter=768, vocab=49152, heads=32)
LLAMA_FTYPES = {"q4_k_m": 15, "q5_k_m": 17}     # llama.h LLAMA_FTYPE_MOSTLY_Q4_K_M, _Q5_K_M
QUANTIZE = """import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = int(sys.argv[3]), 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="*", default=["q4_0", "q8_0"], help="GGUF types to convert to")
    parser.add_argument("--dir", type=Path, default=hardware.kt_home() / "bench" / "qwen3moe-8L")
    parser.add_argument("--llama-cpp", metavar="PYTHON", help="an interpreter with llama-cpp-python (K-quant types)")
    return parser.parse_args()


def checkpoint(directory: Path) -> Path:
    hf = directory / "hf"
    if (hf / "config.json").exists():
        return hf
    config = qwen3_config(**LLAMACPP_SHAPE)
    config.update(head_dim=128, num_key_value_heads=4, num_experts_per_tok=8, intermediate_size=6144,
                  max_position_embeddings=4096)
    with open_checkpoint(store.default_model_path()) as ckpt:
        tokenizer = ckpt.tokenizer()
    config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    staging = directory / "hf.partial"
    write_checkpoint(staging, config)
    tokenizer.save_pretrained(staging)
    staging.rename(hf)
    return hf


def gguf(hf: Path, directory: Path, gguf_type: str, llama_cpp: str | None) -> Path:
    out = directory / f"qwen3moe-8L-{gguf_type.upper()}.gguf"
    if out.exists():
        return out
    if gguf_type in LLAMA_FTYPES:
        if not llama_cpp:
            sys.exit(f"scaled_model.py: {gguf_type} is quantized by llama.cpp: pass --llama-cpp PYTHON")
        source, partial = gguf(hf, directory, "bf16", None), out.with_suffix(".partial")
        subprocess.run([llama_cpp, "-c", QUANTIZE, str(source), str(partial), str(LLAMA_FTYPES[gguf_type])], check=True)
        partial.rename(out)
        return out
    subprocess.run([sys.executable, "-m", "kt_cli", "convert", str(hf), str(out), "--to", "gguf",
                    "--gguf-type", gguf_type], check=True)
    return out


def main() -> None:
    args = parse_args()
    hf = checkpoint(args.dir)
    print(hf)
    for gguf_type in args.types:
        print(gguf(hf, args.dir, gguf_type, args.llama_cpp))


if __name__ == "__main__":
    main()
