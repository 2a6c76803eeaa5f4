"""Chat with an instruction model: the conversation kept in the KV cache (conversation), chat
templates from strangers rendered under bounds (sandbox) and in a child process that can be killed
(template_process)."""

from typing import Any

# `from qkv.chat import ChatSession` reads as it did when chat was one module; the conversation
# module (and torch) are imported on first use, so the template child process stays light.
_CONVERSATION = ("ChatModel", "ChatSession", "ChatTemplate", "ReplySettings", "chat_model_from", "load_chat_model", "streaming_kind")


def __getattr__(name: str) -> Any:
    if name in _CONVERSATION:
        from qkv.chat import conversation

        return getattr(conversation, name)
    if name == "Sampling":  # its name in 0.1, for one release
        import warnings

        from qkv.chat import conversation

        warnings.warn("qkv.chat.Sampling is now qkv.chat.ReplySettings; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return conversation.ReplySettings
    raise AttributeError(f"module 'qkv.chat' has no attribute {name!r}")
