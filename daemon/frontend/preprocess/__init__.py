"""Request preprocessing and response postprocessing for the frontend, free of HTTP code.

Requests go text -> chat template -> token ids; responses go token ids -> text deltas -> stop
strings. The HTTP layer calls these per request.
"""

from .chat_template import ChatTemplate, normalize_messages
from .detokenizer import IncrementalDetokenizer
from .stop import StopStringMatcher
from .tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "StopStringMatcher", "Tokenizer", "normalize_messages"]
