"""Prefill/decode disaggregation on SGLang: its own KV transfer, rendezvous by bootstrap room.

SGLang runs a prefill engine with ``--disaggregation-mode prefill`` and a decode engine with
``--disaggregation-mode decode``; the two meet through the prefill engine's bootstrap server
(``--disaggregation-bootstrap-port``) and move KV with ``--disaggregation-transfer-backend``
(NIXL here unless the operator picks another). A request pair is tied by the same
``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` passed to ``async_generate`` on both ends.

So a prefill leg answers *before* it computes: the adapter allocates a room (a random 63-bit
integer, as Dynamo's prefill handler does), yields it at once as ``disaggregated_params`` and only
then runs the prefill, which blocks in SGLang until the decode engine has joined the room. The
frontend starts the decode leg on that first frame and drains the prefill stream in the background
(daemon/engines/common/disagg.py has the contract).

The host advertised is where decode engines reach the bootstrap server: the host of SGLang's
``--dist-init-addr`` when set (multi-node SGLang), else the daemon's ``--host``.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from dynamod.daemon.engines.common import flags
from dynamod.daemon.engines.common.disagg import ROLE_AGG, ROLE_PREFILL
from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.transport.ports import free_port_run

MODE_FLAG = "--disaggregation-mode"
BACKEND_FLAG = "--disaggregation-transfer-backend"
BOOTSTRAP_PORT_FLAG = "--disaggregation-bootstrap-port"
DEFAULT_TRANSFER_BACKEND = "nixl"
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
_ROOM_MAX = 2**63 - 1


def disaggregation_argv(tokens: Sequence[str], role: str) -> list[str]:
    """SGLang flags to add for ``role``: the mode, NIXL unless a backend is chosen, and (prefill) a
    free bootstrap port unless one is given, so several prefill engines can share a host (SGLang's
    fixed default, 8998, would collide)."""
    given = flags.flag_value(tokens, MODE_FLAG)
    if role == ROLE_AGG:
        if given not in (None, "null"):
            raise ConfigError(f"{MODE_FLAG} {given} in --sglang-args needs --role {given}, not agg")
        return []
    if given is not None and given != role:
        raise ConfigError(f"{MODE_FLAG} {given} in --sglang-args contradicts --role {role}")
    out: list[str] = [] if given is not None else [MODE_FLAG, role]
    if not flags.has_flag(tokens, BACKEND_FLAG):
        out += [BACKEND_FLAG, DEFAULT_TRANSFER_BACKEND]
    if role == ROLE_PREFILL and not flags.has_flag(tokens, BOOTSTRAP_PORT_FLAG):
        out += [BOOTSTRAP_PORT_FLAG, str(free_port_run(1))]
    return out


def _host_of(addr: str) -> str:
    """The host part of ``host:port``, ``[v6]:port`` or a bare host."""
    addr = addr.strip()
    if addr.startswith("["):
        return addr[1:addr.find("]")] if "]" in addr else addr.strip("[]")
    if addr.count(":") == 1:
        return addr.rsplit(":", 1)[0]
    return addr


def bootstrap_endpoint(server_args: Any, advertise_host: str) -> tuple[str, int]:
    """Where decode engines reach this prefill engine's bootstrap server."""
    port = int(server_args.disaggregation_bootstrap_port)
    dist = getattr(server_args, "dist_init_addr", None)
    if dist:
        return socket.gethostbyname(_host_of(str(dist))), port
    if advertise_host in ("", "0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname()), port
    return advertise_host, port


def prefill_bootstrap(host: str, port: int, incoming: Mapping[str, Any] | None) -> dict[str, Any]:
    """The prefill leg's rendezvous: a room the frontend chose (when it sends one), else a new one."""
    room = (incoming or {}).get("bootstrap_room")
    if room is None:
        room = random.randint(0, _ROOM_MAX)
    elif not isinstance(room, int) or isinstance(room, bool) or not 0 <= room <= _ROOM_MAX:
        raise InvalidRequestError(f"bootstrap_room must be an integer in [0, 2^63), got {room!r}")
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def decode_bootstrap(params: Mapping[str, Any]) -> dict[str, Any]:
    """``async_generate`` keyword arguments of a decode leg, from the prefill's parameters."""
    missing = [k for k in BOOTSTRAP_KEYS if params.get(k) is None]
    if missing:
        keys = ", ".join(sorted(params)) or "none"
        raise InvalidRequestError(
            f"disaggregated_params are not SGLang bootstrap parameters from an SGLang prefill worker (missing "
            f"{', '.join(missing)}; keys: {keys}); prefill and decode pools must run the same engine"
        )
    host, port, room = params["bootstrap_host"], params["bootstrap_port"], params["bootstrap_room"]
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(room, int):
        raise InvalidRequestError(f"bad SGLang bootstrap parameters: host={host!r} port={port!r} room={room!r}")
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
