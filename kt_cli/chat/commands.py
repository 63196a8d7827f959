"""Slash commands of the interactive chat: a table of name -> handler."""

from collections.abc import Callable
from dataclasses import dataclass, replace

from .conversation import Conversation
from .options import ChatError, ChatOptions

SETTABLE = ("temperature", "top_p", "max_tokens", "seed")

EXIT = object()


@dataclass(frozen=True)
class Command:
    usage: str
    summary: str
    handler: Callable[["object", str], object]


def run_command(repl, line: str) -> object:
    name, _, arg = line.strip().partition(" ")
    command = COMMANDS.get(name.lower())
    if command is None:
        repl.error(f"unknown command {name}; /help lists the commands")
        return None
    try:
        return command.handler(repl, arg.strip())
    except ChatError as err:
        repl.error(str(err))
        return None


def _help(repl, arg: str) -> None:
    from .terminal import INPUT_HELP

    width = max(len(c.usage) for c in COMMANDS.values())
    for command in dict.fromkeys(COMMANDS.values()):
        repl.note(f"  {command.usage.ljust(width)}  {command.summary}")
    repl.note(INPUT_HELP)


def _clear(repl, arg: str) -> None:
    repl.session.conversation.clear()
    repl.note("new conversation" + (" (system prompt kept)" if repl.session.conversation.system else ""))


def _system(repl, arg: str) -> None:
    conversation = repl.session.conversation
    if not arg:
        repl.note(f"system prompt: {conversation.system!r}" if conversation.system else
                  "no system prompt (the model's template default applies); /system TEXT sets one")
        return
    conversation.system = None if arg == "-" else arg
    repl.note("system prompt cleared" if arg == "-" else "system prompt set")


def _save(repl, arg: str) -> None:
    path = repl.session.conversation.save(_need_file(arg, "/save"), repl.session.backend.model_name)
    repl.note(f"saved {len(repl.session.conversation.messages())} messages to {path}")


def _load(repl, arg: str) -> None:
    loaded = Conversation.load(_need_file(arg, "/load"))
    repl.session.conversation.system, repl.session.conversation.turns = loaded.system, loaded.turns
    system = " and a system prompt" if loaded.system else ""
    repl.note(f"loaded {len(loaded.turns)} messages{system} from {arg}")


def _stats(repl, arg: str) -> None:
    session, backend, totals = repl.session, repl.session.backend, repl.session.totals
    speed = f"{(totals.tokens - totals.replies) / totals.decode_seconds:.1f} tok/s" \
        if totals.decode_seconds > 0 and totals.tokens > totals.replies else "n/a"
    used = totals.last_prompt_tokens
    context = f"{used if used is not None else '?'} of {backend.ctx or '?'} tokens used"
    s = session.sampling
    rows = [("model", f"{backend.model_name} ({backend.where})"),
            ("conversation", f"{len(session.conversation.turns)} messages; {context}"),
            ("replies", f"{totals.replies}, {totals.tokens} tokens generated, decode {speed}"),
            ("sampling", f"temperature {s.temperature}, top-p {s.top_p}, "
                         f"max tokens {s.max_tokens or 'until the context is full'}, seed {s.seed}")]
    for label, value in rows:
        repl.note(f"  {label:<13}{value}")


def _set(repl, arg: str) -> None:
    name, _, value = arg.partition(" ")
    name = name.replace("-", "_")
    if name not in SETTABLE or not value.strip():
        raise ChatError(f"usage: /set NAME VALUE with NAME one of {', '.join(SETTABLE)}")
    session = repl.session
    session.sampling = replace(session.sampling, **{name: _parse_setting(name, value.strip())})
    repl.note(f"{name} = {getattr(session.sampling, name)}")


def _parse_setting(name: str, value: str):
    if value.lower() == "none" and name in ("max_tokens", "seed"):
        return None
    try:
        number = float(value) if name in ("temperature", "top_p") else int(value)
    except ValueError:
        raise ChatError(f"{name} needs a number, got {value!r}") from None
    options = replace(ChatOptions(), **{name: number})
    return getattr(options, name)


def _exit(repl, arg: str) -> object:
    return EXIT


def _need_file(arg: str, command: str) -> str:
    if not arg:
        raise ChatError(f"{command} needs a file name: {command} FILE")
    return arg


_EXIT = Command("/exit", "leave (also /quit, Ctrl-D)", _exit)
COMMANDS: dict[str, Command] = {
    "/help": Command("/help", "this list", _help),
    "/clear": Command("/clear", "start a new conversation (keeps the system prompt)", _clear),
    "/system": Command("/system [TEXT|-]", "show, set or (with -) clear the system prompt", _system),
    "/save": Command("/save FILE", "save the conversation as JSON", _save),
    "/load": Command("/load FILE", "replace the conversation with one saved by /save", _load),
    "/stats": Command("/stats", "model, context use and speed so far", _stats),
    "/set": Command("/set NAME VALUE", "change temperature, top_p, max_tokens or seed", _set),
    "/exit": _EXIT,
    "/quit": _EXIT,
}
