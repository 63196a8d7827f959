"""`kt eval`: load a model, read a text file, measure perplexity. Returns the JSON
document the command prints (schema "kt.eval/1", documented in README)."""

import time
from pathlib import Path

from .errors import KtError

SCHEMA = "kt.eval/1"


def perplexity_of_file(model: str, text_file: str, ctx: int = 512, threads: int | None = None) -> dict:
    from .eval import perplexity
    from .llm import LLM
    text = _read_text(Path(text_file))
    started = time.perf_counter()
    llm = LLM(model, ctx=max(ctx, 16), max_batch=2, threads=threads)
    loaded = time.perf_counter()
    result = perplexity(llm, text, ctx=ctx)
    done = time.perf_counter()
    return {"schema": SCHEMA, "model": str(model), "file": str(text_file),
            **result.to_dict(), "load_seconds": round(loaded - started, 2),
            "eval_seconds": round(done - loaded, 2),
            "tokens_per_second": round(result.n_chunks * ctx / max(done - loaded, 1e-9), 1)}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KtError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KtError(f"{path}: cannot read text ({exc})") from None
