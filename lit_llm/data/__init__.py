"""Data layer: chat History with exact assistant masks, named chat templates, typed containers, chat-text parsing,
errors."""

from lit_llm.data.chat_parsing import parse_chat_text
from lit_llm.data.chat_template import add_chat_template
from lit_llm.data.containers import ChatHistory, LogProbs, Masks, Text, Tokens
from lit_llm.data.errors import (
    ChatTemplateError,
    InvalidConversationError,
    NoAssistantTokensError,
    PrefixMismatchError,
    SpecialTokenInContentError,
    UnknownChatTemplateError,
    check_prefix,
)
from lit_llm.data.history import History

__all__ = [
    "ChatHistory",
    "ChatTemplateError",
    "History",
    "InvalidConversationError",
    "LogProbs",
    "Masks",
    "NoAssistantTokensError",
    "PrefixMismatchError",
    "SpecialTokenInContentError",
    "Text",
    "Tokens",
    "UnknownChatTemplateError",
    "add_chat_template",
    "check_prefix",
    "parse_chat_text",
]
