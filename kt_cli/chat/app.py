"""`run_chat(ChatOptions) -> exit code`: open the backend, then either answer one message
(--prompt, or a message piped on stdin) or run the interactive loop."""

import contextlib
import sys
import threading
from pathlib import Path

from rich.console import Console

from .. import store
from ..hardware import kt_home
from .backend import Backend, BackendError, Sampling
from .conversation import Conversation
from .options import INTERACTIVE_TEMPERATURE, ONE_SHOT_TEMPERATURE, ChatError, ChatOptions
from .session import ChatSession
from .terminal import interrupts_to

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def run_chat(options: ChatOptions) -> int:
    errors = Console(stderr=True, highlight=False)
    try:
        message = _one_shot_message(options)
        backend = open_backend(options, errors)
    except ChatError as err:
        _print_error(errors, err)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    with contextlib.closing(backend):
        session = ChatSession(backend, Conversation(options.system), sampling_of(options, message is not None))
        try:
            if message is not None:
                return answer_once(session, message, errors)
            from .repl import Repl

            return Repl(session, Console(highlight=False), history_path()).run()
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED


def open_backend(options: ChatOptions, errors: Console) -> Backend:
    if options.url is not None:
        from .remote import RemoteBackend

        return RemoteBackend(options.url, options.model)
    from .local import LocalBackend

    model = options.model or _default_model()
    errors.print(f"loading {model} ...", style="dim", soft_wrap=True)
    return LocalBackend(model, threads=options.threads, ctx=options.ctx)


def answer_once(session: ChatSession, message: str, errors: Console) -> int:
    """Only the reply goes to stdout; stats and errors go to stderr."""
    cancel = threading.Event()
    try:
        with interrupts_to(cancel):
            stats = session.reply(message, _write_stdout, cancel)
    except BackendError as err:
        _print_error(errors, err)
        return EXIT_ERROR
    if stats.text and not stats.text.endswith("\n"):
        _write_stdout("\n")
    errors.print(stats.summary(), style="dim")
    return EXIT_INTERRUPTED if stats.finish_reason == "abort" else 0


def sampling_of(options: ChatOptions, one_shot: bool = False) -> Sampling:
    temperature = options.temperature
    if temperature is None:
        temperature = ONE_SHOT_TEMPERATURE if one_shot else INTERACTIVE_TEMPERATURE
    return Sampling(temperature, options.top_p, options.max_tokens, options.seed)


def history_path() -> Path:
    return kt_home() / "chat_history"


def _one_shot_message(options: ChatOptions) -> str | None:
    if options.prompt is not None:
        return options.prompt
    if sys.stdin is None or sys.stdin.isatty():
        return None
    text = sys.stdin.read().strip()
    if not text:
        raise ChatError("stdin is not a terminal and holds no message; give --prompt TEXT or type in a terminal")
    return text


def _default_model() -> str:
    path = store.default_model_path()
    if not path.is_file():
        raise ChatError(f"no MODEL given and the default model is not installed at {path}; "
                        f"run ./install.sh or give a MODEL")
    return str(path)


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _print_error(errors: Console, err: Exception) -> None:
    errors.print(f"[red]error:[/] {err}", soft_wrap=True)
