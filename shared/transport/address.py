"""The address a server tells its peers to dial."""

from __future__ import annotations

import socket

WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def advertised_host(bind_host: str) -> str:
    """The bind address, or this host's primary address when the server binds every interface
    (a wildcard is not an address another machine can use)."""
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks a route
        return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostname()
    finally:
        probe.close()
