"""Finds the image parts of chat messages and checks their shape, before anything is fetched.

OpenAI's chat part is ``{"type": "image_url", "image_url": {"url": ..., "detail": "auto|low|high"}}``;
vLLM also takes ``"image_url": "<url>"``, and so do we. The Responses API's ``input_image`` part is
converted into that shape by its own schema (responses/schema.py), which records the part's place
in the Responses input under ``WHERE_KEY`` so an error names ``input[0].content[1]``, the client's
own coordinates, rather than the chat message it became.

Every problem is an ``InvalidRequestError`` (400) whose message starts with the part's place, e.g.
``messages[1].content[2]: image_url.detail must be auto, low or high``, and whose ``param`` is it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynamod.shared.errors import InvalidRequestError

IMAGE_PART_TYPE = "image_url"
DETAILS = ("auto", "low", "high")
WHERE_KEY = "x-dynamod-where"  # set by a surface that converted the part from its own shape
ERROR_CODE = "invalid_image"


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image part: where it is in the request, its URL (data: or http(s)) and its detail."""

    where: str
    url: str
    detail: str = "auto"


def image_error(where: str, message: str) -> InvalidRequestError:
    """The 400 for a bad image part, naming it first."""
    return InvalidRequestError(f"{where}: {message}", param=where, code=ERROR_CODE)


def is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == IMAGE_PART_TYPE


def has_images(messages: Any) -> bool:
    """Whether any message has an image part (a cheap scan; the shapes are checked later)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            return True
    return False


def image_ref(where: str, part: Mapping[str, Any]) -> ImageRef:
    """The image of one ``image_url`` part, its shape checked."""
    where = part.get(WHERE_KEY) or where
    spec = part.get("image_url")
    detail: Any = "auto"
    if isinstance(spec, str):
        url = spec
    elif isinstance(spec, Mapping):
        url = spec.get("url")
        detail = spec.get("detail") if spec.get("detail") is not None else "auto"
        unknown = sorted(set(spec) - {"url", "detail"})
        if unknown:
            raise image_error(where, f"image_url has unknown field {unknown[0]!r}; it takes 'url' and 'detail'")
    else:
        raise image_error(where, "image_url must be an object {'url': ..., 'detail': ...} or a URL string")
    if not isinstance(url, str) or not url:
        raise image_error(where, "image_url.url must be a non-empty string (a data: URL or an http(s) URL)")
    if detail not in DETAILS:
        raise image_error(where, f"image_url.detail must be one of {', '.join(DETAILS)}, got {detail!r}")
    return ImageRef(where=where, url=url, detail=detail)


def collect_images(messages: Sequence[Any], max_images: int) -> list[ImageRef]:
    """The request's images in prompt order; more than ``max_images`` is a 400 naming the first
    one over the limit. Messages that are not objects are left to the template's checks."""
    refs: list[ImageRef] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not is_image_part(part):
                continue
            where = f"messages[{i}].content[{j}]"
            if len(refs) >= max_images:
                raise image_error(
                    part.get(WHERE_KEY) or where,
                    f"too many images: this server takes at most {max_images} per request (--max-images-per-request)",
                )
            refs.append(image_ref(where, part))
    return refs
