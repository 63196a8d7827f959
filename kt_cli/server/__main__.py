"""python -m kt_cli.server --model PATH --port N ...: the server without the kt CLI."""

import argparse
import os
import sys
from pathlib import Path

from ..errors import KtError
from . import ServeOptions, serve


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kt_cli.server", description="OpenAI-compatible server over kt")
    p.add_argument("--model", help="GGUF file, HF or kt directory, or cached repo id (default: kt's default model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("KT_API_KEY"), help="require 'Authorization: Bearer KEY' (env KT_API_KEY)")
    p.add_argument("--served-model-name", help="model name clients send (default: the file or directory name)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--ctx", type=int)
    p.add_argument("--threads", type=int, default=int(os.environ["KT_THREADS"]) if os.environ.get("KT_THREADS") else None)
    p.add_argument("--kv-memory-gb", type=float)
    p.add_argument("--max-step-tokens", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefix-cache-disk", type=Path, metavar="DIR")
    p.add_argument("--prefix-cache-disk-gb", type=float, default=10.0)
    p.add_argument("--prefix-cache-ram-gb", type=float, default=4.0)
    p.add_argument("--shutdown-timeout-s", type=float, default=10.0)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--gpu-experts", type=int, metavar="N", help="routed experts per MoE layer on the GPU (default: auto; 0 without a GPU)")
    p.add_argument("--gpu-experts-ratio", type=float, metavar="R", help="share of all routed experts on the GPU (0..1)")
    p.add_argument("--placement", default="uniform", choices=["uniform", "frequency", "front-loading", "random"])
    p.add_argument("--expert-stats", type=Path, metavar="FILE", help="recorded expert statistics, for --placement frequency")
    p.add_argument("--record-expert-stats", type=Path, metavar="FILE", help="write routed-token counts (.json or .safetensors)")
    p.add_argument("--prefill-replace-tokens", type=int, metavar="N", help="re-place device experts on each prefill of >= N tokens")
    p.add_argument("--decode-replace-tokens", type=int, metavar="N", help="swap hot experts in every N decode tokens (background upload)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = vars(parser().parse_args(argv))
    try:
        serve(ServeOptions(**args))
    except KtError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
