"""Subject, stream and consumer names for the NATS event plane, in one place.

``nats_subject`` (plane.py) gives the subject of one scope; this module adds the ``"*"`` component
(every component of a namespace) and the JetStream names derived from a scope. One stream per
(namespace, topic) captures every component of that namespace, so a durable consumer can filter on
one component or on all of them without needing a second, overlapping stream.
"""

from __future__ import annotations

import re

from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.events.plane import nats_subject

ANY_COMPONENT = "*"
# JetStream names may not contain whitespace, '.', '*', '>', or path separators.
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_-]")


def scope_subject(namespace: str, component: str, topic: str) -> str:
    """The subject to publish or subscribe on; component ``"*"`` becomes a one-token wildcard."""
    if component != ANY_COMPONENT:
        return nats_subject(namespace, component, topic)
    # nats_subject cleans names so each is one token: namespace.{ns}.component.{c}.{topic}
    tokens = nats_subject(namespace, "x", topic).split(".")
    tokens[3] = "*"
    return ".".join(tokens)


def stream_name(namespace: str, topic: str) -> str:
    """JetStream stream holding ``topic`` for every component of ``namespace``."""
    return f"dynamod-events_{_safe(namespace)}_{_safe(topic)}"


def stream_subject(namespace: str, topic: str) -> str:
    return scope_subject(namespace, ANY_COMPONENT, topic)


def consumer_name(durable_name: str) -> str:
    """Validates a durable consumer name: stable across restarts, so it must not be mangled."""
    if not durable_name or _UNSAFE_NAME.search(durable_name):
        raise InvalidRequestError(
            f"durable_name must be non-empty and use only letters, digits, '_' and '-', got {durable_name!r}",
            param="durable_name",
        )
    return durable_name


def _safe(name: str) -> str:
    return _UNSAFE_NAME.sub("_", name)
