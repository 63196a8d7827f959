"""`python -m kt_cli.chat [MODEL] [options]`: the same options as `kt chat`."""

import argparse
import sys

from kt_weights.errors import WeightsError

from ..errors import KtError
from . import ChatOptions, run_chat


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kt_cli.chat",
                                description="Chat with a model in the terminal (streaming).")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="GGUF file, model directory or cached HF repo id (default: kt's default model); "
                        "with --url, the server's model name")
    p.add_argument("--url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--temperature", type=float, default=ChatOptions.temperature)
    p.add_argument("--top-p", type=float, default=ChatOptions.top_p)
    p.add_argument("--max-tokens", type=int, help="reply length cap (default: until the context is full)")
    p.add_argument("--seed", type=int)
    p.add_argument("--prompt", help="answer this message, print only the reply, exit")
    p.add_argument("--threads", type=int, help="CPU threads for the in-process model")
    p.add_argument("--ctx", type=int, help="context length for the in-process model")
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(parser().parse_args(argv))
    try:
        return run_chat(ChatOptions(**args))
    except (KtError, WeightsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
