"""What a ``dynamod up`` supervisor tells the cluster about the workers it gave up on, and how an
operator asks it to try one again (issue 24 item 6).

A worker in a crash loop is no longer restarted, but its pool keeps serving. It has no instance
record (its process is gone), so without a word of its own it would vanish from ``dynamoctl
status`` and the console. The supervisor writes one ``FailedWorker`` per such worker under its
lease (gone with the supervisor) and deletes it when the worker runs again; ``dynamoctl restart
NAME`` writes a ``RestartRequest`` (no lease), which the supervisor acts on and deletes.

    v1/supervisor/{ns}/failed/{name}    -> FailedWorker
    v1/supervisor/{ns}/restart/{name}   -> RestartRequest
"""

from __future__ import annotations

import msgspec

from dynamod.shared.errors import InvalidRequestError

SUPERVISOR_ROOT = "v1/supervisor/"


def _check_segment(name: str, what: str) -> str:
    if not name or "/" in name:
        raise InvalidRequestError(f"{what} must be a non-empty name without '/', got {name!r}")
    return name


class FailedWorker(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A worker child its supervisor gave up on (it died ``crashes`` times within ``window_s``)."""

    name: str  # the child's name, which is also its worker name (``worker-1``)
    pool: str = ""  # agg | prefill | decode
    reason: str = ""  # the last death: "exit code 1", "killed by SIGKILL", "hung (...)"
    crashes: int = 0
    window_s: float = 0.0
    log: str = ""  # its log file, where the reason is
    supervisor_pid: int = 0
    ts: float = 0.0  # unix time it was given up on


class RestartRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An operator's request to start a failed worker again (``dynamoctl restart NAME``)."""

    name: str
    by: str = ""
    ts: float = 0.0


def failed_prefix(namespace: str) -> str:
    return f"{SUPERVISOR_ROOT}{_check_segment(namespace, 'namespace')}/failed/"


def failed_key(namespace: str, name: str) -> str:
    return failed_prefix(namespace) + _check_segment(name, "worker name")


def restart_prefix(namespace: str) -> str:
    return f"{SUPERVISOR_ROOT}{_check_segment(namespace, 'namespace')}/restart/"


def restart_key(namespace: str, name: str) -> str:
    return restart_prefix(namespace) + _check_segment(name, "worker name")
