"""Request preprocessing and response postprocessing for the frontend, free of HTTP code.

Requests go text -> chat template -> token ids; responses go token ids -> text deltas -> stop
strings. The HTTP layer calls these per request.
"""

from .byte_level import ByteLevelDetokenizer, ByteLevelTable
from .chat_template import ChatTemplate, normalize_messages
from .detokenizer import Detokenizer, IncrementalDetokenizer
from .stop import StopStringMatcher
from .tokenizer import Tokenizer

__all__ = [
    "ByteLevelDetokenizer",
    "ByteLevelTable",
    "ChatTemplate",
    "Detokenizer",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "Tokenizer",
    "normalize_messages",
]
