"""etcd endpoint strings: parsed, checked and written back one way for every role and tool.

Below both the backend chooser (``factory.py``, which reads ``$ETCD_ENDPOINTS``) and the etcd
store (``etcd.py``, which dials them), and free of gRPC, so the settings of a role or of the
console can check endpoints without loading the etcd client.
"""

from __future__ import annotations

from dynamod.shared.errors import ConfigError

DEFAULT_ETCD_ENDPOINT = "http://127.0.0.1:2379"
DEFAULT_ETCD_PORT = 2379


def parse_etcd_endpoints(value: str) -> list[str]:
    """``"host:port,https://host2:port"`` -> ``["http://host:port", "https://host2:port"]``.

    Accepts ``host``, ``host:port``, ``[v6]:port``, ``http://`` and ``https://`` forms (default port
    2379, default scheme http); raises ConfigError naming the bad item otherwise, or when http and
    https are mixed (one gRPC channel is either plaintext or TLS).
    """
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"no etcd endpoints in {value!r}; expected e.g. http://127.0.0.1:2379")
    endpoints = [_normalize_endpoint(item) for item in items]
    etcd_scheme(endpoints)
    return endpoints


def parse_etcd_endpoint(item: str) -> tuple[str, str, int]:
    """``host`` / ``host:port`` / ``[v6]:port`` / ``http(s)://host:port`` -> (scheme, host, port)."""
    rest = item.strip()
    scheme = "http"
    if "://" in rest:
        scheme, _, rest = rest.partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise ConfigError(
                f"etcd endpoint {item!r}: only http:// and https:// endpoints are supported, e.g. https://10.0.0.1:2379"
            )
    rest = rest.rstrip("/")
    if not rest or "/" in rest:
        raise ConfigError(f"etcd endpoint {item!r} is not host:port, e.g. 127.0.0.1:2379")
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    elif rest.count(":") == 1:
        host, _, port = rest.partition(":")
    elif rest.count(":") > 1:  # a bare IPv6 literal
        host, port = rest, ""
    else:
        host, port = rest, ""
    if not host or (port and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ConfigError(f"etcd endpoint {item!r} is not host:port, e.g. 127.0.0.1:2379")
    return scheme, host, int(port) if port else DEFAULT_ETCD_PORT


def split_etcd_endpoint(item: str) -> tuple[str, int]:
    """``host`` / ``host:port`` / ``[v6]:port`` / ``http(s)://host:port`` -> (host, port)."""
    _, host, port = parse_etcd_endpoint(item)
    return host, port


def etcd_scheme(endpoints: list[str]) -> str:
    """``http`` or ``https`` for a list of endpoints; ConfigError when they mix the two."""
    schemes = {parse_etcd_endpoint(e)[0] for e in endpoints}
    if len(schemes) > 1:
        raise ConfigError(f"etcd endpoints mix http:// and https:// ({', '.join(endpoints)}); use one")
    return schemes.pop() if schemes else "http"


def format_etcd_endpoint(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _normalize_endpoint(item: str) -> str:
    scheme, host, port = parse_etcd_endpoint(item)
    return format_etcd_endpoint(host, port, scheme)
