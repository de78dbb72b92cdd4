"""The frontend's limits on images in requests: which hosts may be fetched, how much, how long.

Images arrive as data URLs (in the request body, so ``--max-body-bytes`` bounds them too) or as
http(s) URLs the frontend fetches. Fetching a URL a client names is a server-side request on the
client's behalf, so it is off unless ``--allowed-media-domains`` lists the host (as vLLM's flag of
the same name), and bounded in bytes, seconds and redirects; every redirect target must be listed
as well. Flags win over the ``DYN_*`` environment, which wins over the defaults.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dynamod.shared.config import env_or
from dynamod.shared.errors import ConfigError

DEFAULT_MAX_IMAGES_PER_REQUEST = 16
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # OpenAI's per-image limit
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000  # refused before decoding: a decompression bomb costs nothing
DEFAULT_MEDIA_FETCH_TIMEOUT_S = 10.0
DEFAULT_MEDIA_MAX_REDIRECTS = 3


@dataclass(frozen=True, slots=True)
class MediaSettings:
    """Limits applied to every image of every request (per frontend process)."""

    allowed_domains: frozenset[str] = frozenset()  # lower-case host names; empty: no URL is fetched
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout_s: float = DEFAULT_MEDIA_FETCH_TIMEOUT_S
    max_redirects: int = DEFAULT_MEDIA_MAX_REDIRECTS

    def host_allowed(self, host: str) -> bool:
        """``host`` (from a URL) is listed: exactly, case-insensitively; no wildcard, no suffix match."""
        return host.lower().rstrip(".") in self.allowed_domains


def parse_domains(value: str | list[str] | None) -> frozenset[str]:
    """Host names from ``--allowed-media-domains`` (repeated, space- or comma-separated)."""
    if value is None:
        return frozenset()
    items = [value] if isinstance(value, str) else value
    out: set[str] = set()
    for item in items:
        for host in item.replace(",", " ").split():
            host = host.strip().lower().rstrip(".")
            if "/" in host or ":" in host or "@" in host:
                raise ConfigError(
                    f"--allowed-media-domains takes host names (example.com), not URLs or host:port; got {host!r}"
                )
            out.add(host)
    return frozenset(out)


def add_media_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--allowed-media-domains", nargs="*", default=env_or("DYN_ALLOWED_MEDIA_DOMAINS", "") or None,
                   help="hosts whose http(s) image URLs the frontend may fetch (exact names, space- or "
                        "comma-separated); unset: only data: URLs are accepted [env DYN_ALLOWED_MEDIA_DOMAINS]")
    g.add_argument("--max-images-per-request", type=int,
                   default=int(env_or("DYN_MAX_IMAGES_PER_REQUEST", str(DEFAULT_MAX_IMAGES_PER_REQUEST))),
                   help="images one request may carry; more get 400 [env DYN_MAX_IMAGES_PER_REQUEST, "
                        f"default {DEFAULT_MAX_IMAGES_PER_REQUEST}]")
    g.add_argument("--max-image-bytes", type=int,
                   default=int(env_or("DYN_MAX_IMAGE_BYTES", str(DEFAULT_MAX_IMAGE_BYTES))),
                   help="largest encoded image, data URL or fetched (a data URL is also bounded by --max-body-bytes) "
                        f"[env DYN_MAX_IMAGE_BYTES, default {DEFAULT_MAX_IMAGE_BYTES}]")
    g.add_argument("--max-image-pixels", type=int,
                   default=int(env_or("DYN_MAX_IMAGE_PIXELS", str(DEFAULT_MAX_IMAGE_PIXELS))),
                   help="largest image in width x height, checked before decoding "
                        f"[env DYN_MAX_IMAGE_PIXELS, default {DEFAULT_MAX_IMAGE_PIXELS}]")
    g.add_argument("--media-fetch-timeout", type=float,
                   default=float(env_or("DYN_MEDIA_FETCH_TIMEOUT", str(DEFAULT_MEDIA_FETCH_TIMEOUT_S))),
                   help="seconds one image URL may take to fetch, redirects included "
                        f"[env DYN_MEDIA_FETCH_TIMEOUT, default {DEFAULT_MEDIA_FETCH_TIMEOUT_S:g}]")
    g.add_argument("--media-max-redirects", type=int,
                   default=int(env_or("DYN_MEDIA_MAX_REDIRECTS", str(DEFAULT_MEDIA_MAX_REDIRECTS))),
                   help="redirects an image fetch may follow, each to a listed host "
                        f"[env DYN_MEDIA_MAX_REDIRECTS, default {DEFAULT_MEDIA_MAX_REDIRECTS}]")


def media_settings_from_args(args: argparse.Namespace) -> MediaSettings:
    """The settings from parsed flags; ``ConfigError`` naming the flag for a value out of range."""
    settings = MediaSettings(
        allowed_domains=parse_domains(getattr(args, "allowed_media_domains", None)),
        max_images_per_request=getattr(args, "max_images_per_request", DEFAULT_MAX_IMAGES_PER_REQUEST),
        max_image_bytes=getattr(args, "max_image_bytes", DEFAULT_MAX_IMAGE_BYTES),
        max_image_pixels=getattr(args, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS),
        fetch_timeout_s=getattr(args, "media_fetch_timeout", DEFAULT_MEDIA_FETCH_TIMEOUT_S),
        max_redirects=getattr(args, "media_max_redirects", DEFAULT_MEDIA_MAX_REDIRECTS),
    )
    for flag, value in (("--max-images-per-request", settings.max_images_per_request),
                        ("--max-image-bytes", settings.max_image_bytes),
                        ("--max-image-pixels", settings.max_image_pixels)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if not settings.fetch_timeout_s > 0:
        raise ConfigError(f"--media-fetch-timeout must be > 0, got {settings.fetch_timeout_s}")
    if settings.max_redirects < 0:
        raise ConfigError(f"--media-max-redirects must be 0 or more, got {settings.max_redirects}")
    return settings
