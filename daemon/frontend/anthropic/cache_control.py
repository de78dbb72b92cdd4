"""Anthropic's ``cache_control`` breakpoints -> one pinned prompt prefix (``PreprocessedRequest.pin``).

Anthropic caches the prompt prefix up to a marked block, in its order: ``tools``, then ``system``,
then ``messages``; ``cache_control`` at the top level marks the last block (the whole prompt). Here
the prefix up to the *last* marked block is pinned on the worker, with that breakpoint's TTL
(``5m`` by default, or ``1h``); earlier breakpoints are covered by it.

The pin is counted in prompt tokens, after the chat template: the conversation cut right after the
marked block (its message ends there, no generation prompt) is rendered and tokenized, and the
pinned prefix is the longest common prefix of those tokens with the real prompt's. That is always
a true prefix of the prompt the worker sees, whatever the template does after the cut (a closing
tag, a generation prompt, tools rendered after the system text: the common prefix stops before
them, so such a pin covers less, never something else). A template that cannot render the cut
conversation (one that insists on a user turn) gives no pin rather than an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from dynamod.daemon.frontend.anthropic.convert import (
    AnthropicChatRequest,
    chat_tools,
    conversation_messages,
    tool_cache_control,
)
from dynamod.daemon.frontend.anthropic.schema import CacheControl, CountTokensRequest, MessageParam
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.shared.protocol.llm import PrefixPin

logger = logging.getLogger(__name__)

TTL_SECONDS = {None: 300.0, "5m": 300.0, "1h": 3600.0}  # Anthropic's two TTLs; 5 minutes by default


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """The last marked block: where (``tools``/``system``/``messages``/``request``) and which."""

    where: str
    index: int = -1  # tools[i], system[i], messages[i]
    block: int = -1  # messages[i].content[block]
    ttl_s: float = 300.0


def _ttl(cc: CacheControl) -> float:
    return TTL_SECONDS[cc.ttl]


def last_breakpoint(req: CountTokensRequest) -> Breakpoint | None:
    """The request's last ``cache_control`` mark in Anthropic's prefix order (None: none)."""
    if req.cache_control is not None:
        return Breakpoint("request", ttl_s=_ttl(req.cache_control))
    found: Breakpoint | None = None
    for i, tool in enumerate(req.tools or []):
        cc = tool_cache_control(tool, i)
        if cc is not None:
            found = Breakpoint("tools", i, ttl_s=_ttl(cc))
    if isinstance(req.system, list):
        for i, block in enumerate(req.system):
            if block.cache_control is not None:
                found = Breakpoint("system", i, ttl_s=_ttl(block.cache_control))
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            continue
        for j, block in enumerate(message.content):
            cc = getattr(block, "cache_control", None)
            if cc is not None:
                found = Breakpoint("messages", i, j, ttl_s=_ttl(cc))
    return found


def _cut(req: CountTokensRequest, mark: Breakpoint) -> CountTokensRequest:
    """The request as it stands right after the marked block."""
    replace = msgspec.structs.replace
    if mark.where == "tools":
        return replace(req, tools=(req.tools or [])[: mark.index + 1], system=None, messages=[])
    if mark.where == "system":
        assert isinstance(req.system, list)
        return replace(req, system=req.system[: mark.index + 1], messages=[])
    message = req.messages[mark.index]
    assert isinstance(message.content, list)
    last = MessageParam(role=message.role, content=message.content[: mark.block + 1])
    return replace(req, messages=[*req.messages[: mark.index], last])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


async def pin_for(chat: AnthropicChatRequest, pre: ModelPreprocessor, prompt_ids: list[int]) -> PrefixPin | None:
    """The pin of ``chat``'s Anthropic request, counted on ``prompt_ids`` (None: nothing marked,
    or nothing of the prompt before the mark)."""
    req = chat.anthropic
    if req is None:
        return None
    mark = last_breakpoint(req)
    if mark is None:
        return None
    if mark.where == "request":
        return PrefixPin(num_tokens=len(prompt_ids), ttl_s=mark.ttl_s)
    cut = _cut(req, mark)
    # Renderers want a message: after a tools-only cut an empty user turn stands in (the common
    # prefix stops where it starts).
    messages = conversation_messages(cut) or [{"role": "user", "content": ""}]
    prefix = msgspec.structs.replace(chat, messages=messages, tools=chat_tools(cut.tools), add_generation_prompt=False)
    try:
        cut_ids = await pre.chat_prompt(prefix)
    except Exception as exc:  # noqa: BLE001 - the template refuses the cut conversation: no pin
        logger.debug("cache_control prefix not rendered where=%s error=%s", mark.where, exc)
        return None
    num_tokens = _common_prefix(cut_ids, prompt_ids)
    return PrefixPin(num_tokens=num_tokens, ttl_s=mark.ttl_s) if num_tokens else None
