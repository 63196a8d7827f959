"""The conversation: an optional system prompt and the user/assistant turns, saved as JSON.

File format (kt.chat/1): {"format": "kt.chat/1", "model": str | null,
"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]},
the system message, if any, first: the same list an OpenAI chat request takes."""

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .options import ChatError

FORMAT = "kt.chat/1"
TURN_ROLES = ("user", "assistant")


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(turn) for turn in self.turns]

    def add(self, role: str, content: str) -> None:
        if role not in TURN_ROLES:
            raise ChatError(f"a turn's role must be one of {TURN_ROLES}, got {role!r}")
        self.turns.append({"role": role, "content": content})

    def clear(self) -> None:
        self.turns = []

    def save(self, path: str | Path, model: str | None = None) -> Path:
        """Atomic: a temporary file beside the target, then a rename over it."""
        target = Path(path).expanduser()
        document = {"format": FORMAT, "model": model, "messages": self.messages()}
        try:
            _write_atomic(target, json.dumps(document, indent=2, ensure_ascii=False) + "\n")
        except OSError as err:
            raise ChatError(f"cannot save to {target}: {err.strerror or err}") from None
        return target

    @classmethod
    def load(cls, path: str | Path) -> "Conversation":
        source = Path(path).expanduser()
        try:
            document = json.loads(source.read_text(encoding="utf-8"))
        except OSError as err:
            raise ChatError(f"cannot read {source}: {err.strerror or err}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ChatError(f"{source} is not a JSON file ({err})") from None
        return cls.from_messages(_messages_of(document, source), source)

    @classmethod
    def from_messages(cls, messages: list, where: Path | str = "conversation") -> "Conversation":
        for i, message in enumerate(messages):
            _check_message(message, i, where)
        system = None
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        if any(m["role"] == "system" for m in messages):
            raise ChatError(f"{where}: only the first message may have the role 'system'")
        return cls(system, [{"role": m["role"], "content": m["content"]} for m in messages])


def _messages_of(document, source: Path) -> list:
    if not isinstance(document, dict) or not isinstance(document.get("messages"), list):
        raise ChatError(f"{source} is not a saved conversation (no \"messages\" list)")
    if document.get("format", FORMAT) != FORMAT:
        raise ChatError(f"{source} has format {document['format']!r}; this kt reads {FORMAT!r}")
    return document["messages"]


def _check_message(message, index: int, where) -> None:
    ok = (isinstance(message, dict) and message.get("role") in ("system",) + TURN_ROLES
          and isinstance(message.get("content"), str))
    if not ok:
        raise ChatError(f"{where}: message {index} needs a role (system, user or assistant) "
                        f"and a text content")


def _write_atomic(target: Path, text: str) -> None:
    handle = tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=target.parent or ".",
                                         prefix=f".{target.name}.", suffix=".tmp", delete=False)
    try:
        with handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, target)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
