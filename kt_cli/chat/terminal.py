"""Terminal plumbing: reading a message with prompt_toolkit (history, line editing,
multi-line input) and turning Ctrl-C during a reply into a cancel flag."""

import contextlib
import signal
import threading
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings

PROMPT = ">>> "
CONTINUE = "... "
FENCE = '"""'
INPUT_HELP = ('end a line with \\ to continue on the next; """ starts and ends a multi-line block; '
              "Esc Enter inserts a newline; Ctrl-C stops a reply; Ctrl-D or /exit leaves")


class MessageReader:
    def __init__(self, history_path: Path | None):
        self.session = PromptSession(history=_history(history_path), key_bindings=_bindings())

    def read(self) -> str:
        """The next message; "" when the user abandoned a multi-line one. Ctrl-C / Ctrl-D at an
        empty first line raise KeyboardInterrupt / EOFError."""
        first = self.session.prompt(PROMPT)
        try:
            if first.lstrip().startswith(FENCE):
                return self._fenced(first.lstrip()[len(FENCE):])
            return self._continued(first)
        except KeyboardInterrupt:
            return ""

    def _continued(self, line: str) -> str:
        lines = [line]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(self._more())
        return "\n".join(lines)

    def _fenced(self, rest: str) -> str:
        lines = [rest] if rest else []
        while not (lines and lines[-1].rstrip().endswith(FENCE)):
            line = self._more(default_on_eof=FENCE)
            lines.append(line)
        lines[-1] = lines[-1].rstrip()[:-len(FENCE)]
        return "\n".join(lines).strip("\n")

    def _more(self, default_on_eof: str = "") -> str:
        try:
            return self.session.prompt(CONTINUE)
        except EOFError:
            return default_on_eof


@contextlib.contextmanager
def interrupts_to(cancel: threading.Event):
    """While inside, SIGINT sets `cancel` instead of raising KeyboardInterrupt, so the reply
    loop stops between engine steps and the engine stays consistent."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: cancel.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _history(path: Path | None) -> History:
    if path is None:
        return InMemoryHistory()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
        return FileHistory(str(path))
    except OSError:
        return InMemoryHistory()


def _bindings() -> KeyBindings:
    bindings = KeyBindings()

    @bindings.add("c-c")
    def _clear_or_interrupt(event):
        buffer = event.app.current_buffer
        if buffer.text:
            buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt())

    @bindings.add("escape", "enter")
    def _newline(event):
        event.app.current_buffer.insert_text("\n")

    return bindings
