"""The address a server tells its peers to dial.

Every listener of a process (request plane, ZMQ publishers, KV block server, status server, the
frontend's HTTP server) binds one address and writes another into discovery: the one a process on
another host can dial. The two differ when the listener binds a wildcard (``0.0.0.0`` is not an
address anybody can dial) or sits behind NAT (``--advertise-host``). One rule for all of them lives
here, so no listener advertises ``0.0.0.0`` or, on a multi-host cluster, ``127.0.0.1`` by accident.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface
_ROUTE_PROBES = ("10.255.255.255", "192.0.2.1")  # never contacted: a UDP connect only picks a route


def is_wildcard(host: str) -> bool:
    return host in WILDCARD_HOSTS


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses: a listener there is reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def advertised_host(bind_host: str, advertise: str | None = None) -> str:
    """What a listener bound to ``bind_host`` advertises.

    ``advertise`` (``--advertise-host``) wins; otherwise the bind address itself; for a wildcard
    bind, this host's primary address: the source address of its default route, else the first
    non-loopback IPv4 address of an interface that is up (a host on an isolated network, such as a
    cluster network without a default route), else the host name.
    """
    if advertise:
        return advertise
    if not is_wildcard(bind_host):
        return bind_host
    return primary_address()


def primary_address() -> str:
    """This host's address for peers (see ``advertised_host``); never a wildcard."""
    for target in _ROUTE_PROBES:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((target, 1))
            address = str(probe.getsockname()[0])
            if address != "0.0.0.0":
                return address
        except OSError:
            continue
        finally:
            probe.close()
    for address in interface_addresses():
        return address
    return socket.gethostname()


def interface_addresses() -> list[str]:
    """Non-loopback IPv4 addresses of this host's interfaces, in interface index order (Linux)."""
    found: list[str] = []
    try:
        interfaces = socket.if_nameindex()
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in interfaces:
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address, or the interface is down
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                found.append(address)
    return found


def check_advertise_host(value: str, flag: str = "--advertise-host") -> str:
    """A host peers can dial: not empty, not a wildcard, no port or scheme."""
    host = value.strip()
    if not host or is_wildcard(host):
        raise ValueError(f"{flag} must be an address or name peers can dial, not {value!r}")
    if "/" in host or (host.count(":") == 1):
        raise ValueError(f"{flag} takes a host only (no scheme or port), got {value!r}")
    return host


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
