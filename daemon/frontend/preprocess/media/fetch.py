"""Gets an image's bytes from its URL: a ``data:`` URL in the request, or an http(s) URL fetched.

A data URL must be ``data:image/<type>;base64,<payload>`` (as vLLM and OpenAI take them); its size
is checked from the payload's length before it is decoded. An http(s) URL is fetched only when
its host is in ``--allowed-media-domains``, with httpx (the frontend's HTTP client library), one
shared client per frontend process: redirects are followed by hand so that each hop's host is
checked too, at most ``--media-max-redirects`` of them; the body is read in chunks and abandoned
past ``--max-image-bytes``; the whole fetch, redirects included, has ``--media-fetch-timeout``.
Every failure is a 400 naming the part (``parts.image_error``): the client sent a URL we cannot
use, which is not the server's fault.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from urllib.parse import urljoin, urlsplit

import httpx

from dynamod.daemon.frontend.preprocess.media.parts import ImageRef, image_error
from dynamod.daemon.frontend.preprocess.media.settings import MediaSettings

logger = logging.getLogger(__name__)

_REDIRECTS = (301, 302, 303, 307, 308)
INLINE_DATA_URL_CHARS = 96 * 1024  # longer data URLs are decoded on a thread


def data_url_bytes(ref: ImageRef, max_bytes: int) -> bytes:
    """The bytes of a ``data:`` URL (a 400 when it is not an image or too large)."""
    header, sep, payload = ref.url[5:].partition(",")
    if not sep:
        raise image_error(ref.where, "the data URL has no ',' before its payload")
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0] or "text/plain"
    if not media_type.startswith("image/"):
        raise image_error(ref.where, f"the data URL's media type is {media_type!r}, not an image type (image/png, image/jpeg, ...)")
    if "base64" not in params[1:]:
        # Percent-encoded payloads are legal data URLs, but images are not sent that way; vLLM
        # takes base64 only as well.
        raise image_error(ref.where, f"the data URL must be base64-encoded (data:{media_type};base64,...)")
    payload = "".join(payload.split())  # line breaks inside base64 are tolerated
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise image_error(ref.where, f"the image is too large: over {max_bytes} bytes (--max-image-bytes)")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise image_error(ref.where, "the data URL's payload is not valid base64") from None
    if not raw:
        raise image_error(ref.where, "the data URL is empty")
    if len(raw) > max_bytes:
        raise image_error(ref.where, f"the image is too large: {len(raw)} bytes, over {max_bytes} (--max-image-bytes)")
    return raw


class MediaFetcher:
    """Fetches image URLs under ``MediaSettings``; one per frontend process (its client is shared)."""

    def __init__(self, settings: MediaSettings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self._transport = transport  # tests inject one; None: the network
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # No proxies from the environment: the allow-list is about the hosts we connect to.
            self._client = httpx.AsyncClient(
                follow_redirects=False, trust_env=False, transport=self._transport,
                timeout=httpx.Timeout(self.settings.fetch_timeout_s),
                headers={"user-agent": "dynamod-frontend (image fetch)", "accept": "image/*"},
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def get(self, ref: ImageRef) -> bytes:
        """The encoded image ``ref`` names."""
        scheme = ref.url.split(":", 1)[0].lower() if ":" in ref.url else ""
        if scheme == "data":
            if len(ref.url) <= INLINE_DATA_URL_CHARS:
                return data_url_bytes(ref, self.settings.max_image_bytes)
            # Megabytes of base64: decoded on a worker thread, off the event loop.
            return await asyncio.to_thread(data_url_bytes, ref, self.settings.max_image_bytes)
        if scheme not in ("http", "https"):
            raise image_error(ref.where, f"unsupported image URL scheme {scheme or ref.url[:16]!r}: use a data: URL or an http(s) URL")
        if not self.settings.allowed_domains:
            raise image_error(
                ref.where, "this server does not fetch image URLs: send the image as a data: URL "
                "(an operator can allow hosts with --allowed-media-domains)"
            )
        try:
            async with asyncio.timeout(self.settings.fetch_timeout_s):
                return await self._fetch(ref)
        except TimeoutError:
            raise image_error(ref.where, f"fetching the image took longer than {self.settings.fetch_timeout_s:g} s") from None

    def _check_host(self, ref: ImageRef, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise image_error(ref.where, f"the image URL redirected to a {parts.scheme!r} URL; only http(s) is fetched")
        host = parts.hostname or ""
        if not self.settings.host_allowed(host):
            raise image_error(ref.where, f"the image host {host!r} is not in this server's --allowed-media-domains")

    async def _fetch(self, ref: ImageRef) -> bytes:
        url = ref.url
        client = self._http()
        max_bytes = self.settings.max_image_bytes
        for _hop in range(self.settings.max_redirects + 1):
            self._check_host(ref, url)
            try:
                async with client.stream("GET", url) as resp:
                    if resp.status_code in _REDIRECTS:
                        location = resp.headers.get("location")
                        if not location:
                            raise image_error(ref.where, f"fetching the image failed: HTTP {resp.status_code} without a Location")
                        url = urljoin(url, location)
                        continue
                    if resp.status_code != 200:
                        raise image_error(ref.where, f"fetching the image failed: HTTP {resp.status_code}")
                    declared = resp.headers.get("content-length")
                    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                        raise image_error(ref.where, f"the image is too large: {declared} bytes, over {max_bytes} (--max-image-bytes)")
                    body = bytearray()
                    async for chunk in resp.aiter_bytes():
                        body += chunk
                        if len(body) > max_bytes:
                            raise image_error(ref.where, f"the image is too large: over {max_bytes} bytes (--max-image-bytes)")
                    if not body:
                        raise image_error(ref.where, "fetching the image failed: the response was empty")
                    return bytes(body)
            except httpx.HTTPError as exc:
                logger.info("image fetch failed where=%s host=%s error=%s", ref.where, urlsplit(url).hostname, type(exc).__name__)
                raise image_error(ref.where, f"fetching the image failed: {type(exc).__name__}: {exc}") from None
        raise image_error(ref.where, f"fetching the image failed: more than {self.settings.max_redirects} redirects (--media-max-redirects)")
