"""The interactive loop: read a message or a slash command, stream the reply, show its stats."""

import sys
import threading
from pathlib import Path

from rich.console import Console

from .backend import BackendError, ContextOverflow
from .commands import EXIT, run_command
from .session import ChatSession
from .terminal import INPUT_HELP, MessageReader, interrupts_to


class Repl:
    def __init__(self, session: ChatSession, console: Console, history_path: Path | None):
        self.session = session
        self.console = console
        self.reader = MessageReader(history_path)
        self._at_line_start = True

    def run(self) -> int:
        self._banner()
        while True:
            try:
                text = self.reader.read()
            except (KeyboardInterrupt, EOFError):
                return 0
            try:
                if text.startswith("/"):
                    if run_command(self, text) is EXIT:
                        return 0
                elif text.strip():
                    self.send(text)
            except KeyboardInterrupt:
                self._end_line()

    def send(self, text: str) -> None:
        cancel = threading.Event()
        self._at_line_start = True
        try:
            with interrupts_to(cancel):
                stats = self.session.reply(text, self._write, cancel)
        except ContextOverflow as err:
            self._end_line()
            self.error(f"{err}; /clear starts a new conversation")
            return
        except BackendError as err:
            self._end_line()
            self.error(str(err))
            return
        self._end_line()
        self.console.print(stats.summary(), style="dim", highlight=False)
        if stats.context_full:
            self.error("the context is full; /clear starts a new conversation")

    def error(self, message: str) -> None:
        self.console.print(f"[red]error:[/] {message}", highlight=False, soft_wrap=True, markup=True)

    def note(self, message: str) -> None:
        self.console.print(message, highlight=False, soft_wrap=True, markup=False)

    def _banner(self) -> None:
        backend = self.session.backend
        ctx = f", context {backend.ctx} tokens" if backend.ctx else ""
        self.note(f"kt chat · {backend.model_name} ({backend.where}{ctx})")
        self.console.print(f"/help lists commands; {INPUT_HELP}", style="dim", highlight=False, markup=False)

    def _write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self._at_line_start = text.endswith("\n")

    def _end_line(self) -> None:
        if not self._at_line_start:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self._at_line_start = True
