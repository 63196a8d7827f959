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
    p.add_argument("--url", metavar="URL", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--system", metavar="TEXT", help="system prompt")
    p.add_argument("--temperature", type=float, metavar="T", default=ChatOptions.temperature,
                   help="0 = greedy (default: 0 with --prompt or piped stdin, 0.8 interactive)")
    p.add_argument("--top-p", type=float, metavar="P", default=ChatOptions.top_p,
                   help=f"nucleus sampling (default {ChatOptions.top_p})")
    p.add_argument("--max-tokens", type=int, metavar="N", help="reply length cap (default: until the context is full)")
    p.add_argument("--seed", type=int, metavar="N", help="sampling seed, for repeatable replies")
    p.add_argument("--prompt", metavar="TEXT", help="answer this message, print only the reply, exit "
                                                    "(also: a message piped on stdin)")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads for the in-process model (env KT_THREADS)")
    p.add_argument("--ctx", type=int, metavar="N", help="context length for the in-process model")
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
