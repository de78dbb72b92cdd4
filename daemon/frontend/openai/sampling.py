"""A validated OpenAI/vLLM request's sampling fields -> the wire's ``SamplingOptions``.

Every sampling parameter OpenAI and vLLM define either reaches the engine here or is refused with
a 400 naming it: nothing is accepted and then ignored. Structured outputs come in four spellings
(OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*`` fields, Dynamo's
``nvext.guided_*``); they become one ``GuidedDecoding`` whose grammar is compiled here, before
routing, so an invalid schema is a 400 rather than an engine error. A chat request whose
``tool_choice`` is ``required`` or names a function gets the tool-call schema as its constraint
(``parsers/forced_tool_calls.py``), as vLLM does, so the reply cannot be prose.

A request that sets none of these pays a handful of attribute reads: the grammar engine is not
imported until a request carries a constraint.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dynamod.daemon.frontend.openai.schema import NvExt, ResponseFormat, StructuredOutputs
from dynamod.daemon.frontend.parsers.forced_tool_calls import forced_call_schema, forces_call
from dynamod.daemon.frontend.parsers.output import ToolSettings
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.guided_grammar import compile_guided
from dynamod.shared.protocol.llm import GuidedDecoding, SamplingOptions

# vLLM request fields no engine here honours, with the values that mean "off" (accepted).
REFUSED_VLLM_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "logits_processors": ([],),
    "bad_words": ([],),
    "guided_decoding_backend": (),
}
_WHY = {
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "include_stop_str_in_output": "stop strings are always cut from the output here",
    "skip_special_tokens": "special tokens are always skipped in the output text",
    "spaces_between_special_tokens": "special tokens are always skipped in the output text",
    "prompt_logprobs": "prompt logprobs are not supported",
    "truncate_prompt_tokens": "prompt truncation is not supported; shorten the prompt",
    "logits_processors": "custom logits processors are not supported",
    "bad_words": "bad_words is not supported; use logit_bias with the words' token ids",
    "guided_decoding_backend": "the engine picks its structured-output backend",
}
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def sampling_options(req: Any, *, logprobs: int | None, vocab_size: int = 0) -> SamplingOptions:
    """The engine's ``SamplingOptions`` for a decoded chat or completions request; raises
    ``InvalidRequestError`` naming the parameter that cannot be honoured. ``vocab_size`` (0:
    unknown) bounds the token ids of ``logit_bias`` and ``allowed_token_ids``."""
    _refuse_unsupported(req)
    if getattr(req, "top_logprobs", None) and not getattr(req, "logprobs", False):
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    logit_bias = req.logit_bias or None
    if logit_bias is not None:
        _check_ids(logit_bias.keys(), vocab_size, "logit_bias")
    allowed = req.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise InvalidRequestError("allowed_token_ids is empty; give at least one token id", param="allowed_token_ids")
        _check_ids(allowed, vocab_size, "allowed_token_ids")
    return SamplingOptions(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=logit_bias,
        allowed_token_ids=allowed,
        logprobs=logprobs,
        guided_decoding=guided_decoding(req),
    )


def _refuse_unsupported(req: Any) -> None:
    for name, off in REFUSED_VLLM_FIELDS.items():
        value = getattr(req, name)
        if value is not None and not any(value == ok and type(value) is type(ok) for ok in off):
            raise InvalidRequestError(f"{name}={value!r} is not supported: {_WHY[name]}", param=name)
    nvext = req.nvext
    if nvext is not None and nvext.guided_decoding_backend is not None:
        raise InvalidRequestError(
            f"nvext.guided_decoding_backend is not supported: {_WHY['guided_decoding_backend']}",
            param="nvext.guided_decoding_backend",
        )


def _check_ids(ids: Any, vocab_size: int, param: str) -> None:
    if vocab_size:
        top = max(ids)
        if top >= vocab_size:
            raise InvalidRequestError(f"{param}: token id {top} is out of the vocabulary (size {vocab_size})", param=param)


def guided_decoding(req: Any) -> GuidedDecoding | None:
    """The request's one output constraint, compiled and checked; None when it has none.
    Two constraints (say ``response_format`` and ``guided_regex``) are a 400: which one the
    client meant is not ours to guess."""
    found: list[tuple[str, GuidedDecoding]] = []
    if req.response_format is not None:
        g = _from_response_format(req.response_format)
        if g is not None:
            found.append(("response_format", g))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    found.extend(_from_guided_fields(req, "", req.guided_whitespace_pattern))
    nvext: NvExt | None = req.nvext
    if nvext is not None:
        found.extend(_from_guided_fields(nvext, "nvext.", nvext.guided_whitespace_pattern or req.guided_whitespace_pattern))
    tool_choice = getattr(req, "tool_choice", None)  # chat only
    if tool_choice is not None and tool_choice != "auto" and tool_choice != "none":
        forced = _from_tool_choice(req)
        if forced is not None:
            if found:
                raise InvalidRequestError(
                    f"tool_choice {_choice_label(tool_choice)} constrains the output to tool calls, so it cannot be "
                    f"combined with {found[0][0]}; drop one of them",
                    param="tool_choice",
                )
            found.append(("tool_choice", forced))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(f"only one output constraint may be set; got {names}", param=found[1][0])
    param, guided = found[0]
    compile_guided(guided, param=param)
    return guided


def _from_tool_choice(req: Any) -> GuidedDecoding | None:
    """The constraint of a ``required`` or named ``tool_choice`` (None for the other modes)."""
    settings = ToolSettings.from_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    if not forces_call(settings):
        return None
    return GuidedDecoding(json=forced_call_schema(settings, req.tools))


def _choice_label(tool_choice: Any) -> str:
    if isinstance(tool_choice, str):
        return repr(tool_choice)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    return f"naming {name!r}" if name else repr(tool_choice)


def _from_response_format(fmt: ResponseFormat) -> GuidedDecoding | None:
    kind = fmt.type
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding(json={"type": "object"})
    if kind == "json_schema":
        spec = fmt.json_schema
        schema = None if spec is None else (spec.schema if spec.schema is not None else spec.json_schema)
        if schema is None:
            raise InvalidRequestError(
                "response_format of type json_schema needs json_schema.schema", param="response_format.json_schema"
            )
        return GuidedDecoding(json=_schema_value(schema, "response_format.json_schema.schema"))
    if kind == "structural_tag":
        raise InvalidRequestError("response_format of type structural_tag is not supported", param="response_format.type")
    raise InvalidRequestError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}", param="response_format.type"
    )


def _from_structured_outputs(so: StructuredOutputs) -> GuidedDecoding:
    param = "structured_outputs"
    if so.structural_tag is not None:
        raise InvalidRequestError("structured_outputs.structural_tag is not supported", param=f"{param}.structural_tag")
    for flag in ("disable_any_whitespace", "disable_additional_properties"):
        if getattr(so, flag):
            raise InvalidRequestError(f"structured_outputs.{flag} is not supported", param=f"{param}.{flag}")
    set_ = [
        name for name in ("json", "regex", "choice", "grammar", "json_object")
        if getattr(so, name) is not None and getattr(so, name) is not False
    ]
    if len(set_) != 1:
        raise InvalidRequestError(
            f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got {set_ or 'none'}",
            param=param,
        )
    kind = set_[0]
    ws = so.whitespace_pattern
    if kind == "json":
        return GuidedDecoding(json=_schema_value(so.json, f"{param}.json"), whitespace_pattern=ws)
    if kind == "json_object":
        return GuidedDecoding(json={"type": "object"}, whitespace_pattern=ws)
    return GuidedDecoding(regex=so.regex, choice=so.choice, grammar=so.grammar)


def _from_guided_fields(src: Any, prefix: str, whitespace: str | None) -> list[tuple[str, GuidedDecoding]]:
    out = []
    for name in _GUIDED_FIELDS:
        value = getattr(src, name)
        if value is None or (name == "guided_choice" and not value):
            continue  # an empty choice list is no constraint (as in vLLM and Dynamo)
        param = prefix + name
        if name == "guided_json":
            out.append((param, GuidedDecoding(json=_schema_value(value, param), whitespace_pattern=whitespace)))
        elif name == "guided_regex":
            out.append((param, GuidedDecoding(regex=value)))
        elif name == "guided_choice":
            out.append((param, GuidedDecoding(choice=value)))
        else:
            out.append((param, GuidedDecoding(grammar=value)))
    return out


def _schema_value(schema: Any, param: str) -> Any:
    """A JSON schema is an object or a boolean; vLLM also takes it as a JSON string."""
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError as exc:
            raise InvalidRequestError(f"{param} is a string but not JSON: {exc}", param=param) from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(f"{param} must be a JSON schema object, got {type(schema).__name__}", param=param)
    return schema
