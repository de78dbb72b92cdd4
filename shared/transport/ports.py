"""Free ports for servers this process is about to start or hand to a child (``dynamod up``'s
children, an engine's side channels, tests' etcd and NATS, benchmarks' clusters).

A port from ``bind(0)`` lies in the kernel's ephemeral range, the same pool it draws outgoing
connections' local ports from: between the pick and the server's bind any process's connect can
take it (a clean-clone test run lost a frontend fleet to ``Address already in use`` that way).
So ports are picked *below* that range, where only another explicit bind can race, each is
checked by binding it, and this process never hands the same port out twice. When the range
leaves no room below it (a host that widened it to start near 1024), ``bind(0)`` is the fallback.

Standard library only: the benchmarks load this file by path on a bare checkout.
"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

LOWEST = 10000  # below this lie well-known and registered services' ports
_ATTEMPTS = 200


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' local ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems' ranges start higher


EPHEMERAL_LOW = _ephemeral_low()
_handed_out: set[int] = set()
_pick = random.Random(os.getpid() ^ time.monotonic_ns())


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A base port such that ``base .. base+count-1`` are free now on ``host`` and none of them
    was handed out before by this process; the run is then counted as handed out."""
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    if EPHEMERAL_LOW - count > LOWEST + 1000:
        for _ in range(_ATTEMPTS):
            base = _pick.randrange(LOWEST, EPHEMERAL_LOW - count + 1)
            run = range(base, base + count)
            if any(p in _handed_out for p in run) or not all(_bindable(host, p) for p in run):
                continue
            _handed_out.update(run)
            return base
    for _ in range(_ATTEMPTS):  # no room below the ephemeral range: the kernel's pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            base = int(s.getsockname()[1])
        run = range(base, base + count)
        if base + count - 1 <= 65535 and not any(p in _handed_out for p in run) and all(
            _bindable(host, p) for p in run
        ):
            _handed_out.update(run)
            return base
    raise OSError(f"no run of {count} free ports on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    """One port free now on ``host`` that this process has not handed out before."""
    return free_port_run(1, host)
