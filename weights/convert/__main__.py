"""python -m kt_weights.convert SRC DST --to int8|int4|bf16|gguf [options]"""

import argparse
import json
import os
import sys

from ..errors import WeightsError
from . import GGUF_TYPES, GROUP_SIZES, TARGETS, ConvertOptions, TextSink, convert, summary_table_rows
from .options import DEFAULT_GROUP


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kt_weights.convert",
                                description="Convert a Hugging Face checkpoint to kt's format or to GGUF.")
    p.add_argument("src", metavar="SRC", help="HF model directory or cached repo id")
    p.add_argument("dst", metavar="DST", help="output directory (int8/int4/bf16) or .gguf file")
    p.add_argument("--to", required=True, choices=TARGETS)
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP, choices=GROUP_SIZES)
    p.add_argument("--gguf-type", choices=GGUF_TYPES, default=None, help="default q8_0")
    p.add_argument("--experts-only", action="store_true", help="quantize only routed experts")
    p.add_argument("--asymmetric", action="store_true", help="scale + min per group (int8/int4)")
    p.add_argument("--threads", type=int, default=_env_threads())
    p.add_argument("--resume", action="store_true", help="continue an interrupted run")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def _env_threads() -> int | None:
    value = os.environ.get("KT_THREADS")
    return int(value) if value and value.isdigit() else None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        options = ConvertOptions(args.src, args.dst, args.to, args.group_size, args.gguf_type,
                                 args.experts_only, not args.asymmetric, args.threads, args.resume, args.force)
        summary = convert(options, None if args.json else TextSink())
    except WeightsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; rerun with --resume to continue", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(summary.to_dict(), indent=1))
    else:
        for label, value in summary_table_rows(summary):
            print(f"{label:24} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
