"""`kt chat`: an interactive, streaming chat with a model loaded in-process or served
over an OpenAI-compatible API.

  run_chat(ChatOptions) -> exit code
    ChatSession.reply(text)        conversation + user message -> Backend.stream
    Backend.stream(messages, ...)  -> Chunk(text delta) ... Chunk(end=ReplyEnd)
      LocalBackend   LLM.chat_prompt -> LLMEngine.add_request, step() until finished
      RemoteBackend  POST /v1/chat/completions (stream=true), server-sent events
"""

from .app import run_chat
from .options import ChatError, ChatOptions

__all__ = ["ChatError", "ChatOptions", "run_chat"]
