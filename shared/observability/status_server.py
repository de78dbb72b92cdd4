"""The per-process system status server: ``/health``, ``/live``, ``/metrics``.

A deliberately tiny HTTP/1.1 responder on asyncio streams: ``shared/`` stays free of web frameworks
and every process (workers, routers, planner) gets the same three routes with no extra dependency.
``/health`` is 200 only when the process says it is ready (its endpoints are served and it is not
shutting down); ``/live`` is 200 while the event loop runs; ``/metrics`` is Prometheus text.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dynamod.shared.errors import ConfigError
from dynamod.shared.transport.address import advertised_host, join_host_port

logger = logging.getLogger(__name__)

HealthProbe = Callable[[], tuple[bool, dict]]
_MAX_REQUEST_BYTES = 16 * 1024


class StatusServer:
    def __init__(
        self,
        registry: CollectorRegistry,
        health: HealthProbe,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        self._registry = registry
        self._health = health
        self._host = host
        # ``url`` goes into discovery (instances' system_url) for scrapers on other hosts: never a wildcard.
        self._advertise_host = advertise_host or advertised_host(host)
        self._port = port
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.url = ""

    async def start(self) -> str:
        try:
            self._server = await asyncio.start_server(self._serve, self._host, self._port)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve /health and /metrics on {self._host}:{self._port}: {exc.strerror or exc}; "
                "pick another --system-port (0 = any free port) or stop the process holding it"
            ) from None
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{join_host_port(self._advertise_host, port)}"
        logger.info("status server listening url=%s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._server:
            self._server.close()
            # Since Python 3.12 wait_closed() also waits for open connections, and a scraper keeps
            # its keep-alive connection open between scrapes: close them, or shutdown (and the
            # lease revocation after it) would never get past here.
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                    return
                if len(head) > _MAX_REQUEST_BYTES:
                    return
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                parts = request_line.split()
                keep_alive = b"connection: close" not in head.lower()
                if len(parts) < 2:
                    await self._write(writer, 400, "text/plain", b"bad request\n", False)
                    return
                method, path = parts[0], parts[1].split("?", 1)[0]
                status, ctype, body = self._route(method, path)
                await self._write(writer, status, ctype, body if method != "HEAD" else b"", keep_alive)
                if not keep_alive:
                    return
        finally:
            self._writers.discard(writer)
            writer.close()

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        if path == "/live":
            return 200, "application/json", b'{"status":"live"}\n'
        if path == "/health":
            ready, detail = self._health()
            body = json.dumps({"status": "ready" if ready else "notready", **detail}).encode() + b"\n"
            return (200 if ready else 503), "application/json", body
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        return 404, "text/plain", b"not found\n"

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes, keep_alive: bool) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
        head = (
            f"HTTP/1.1 {status} {reason.get(status, 'OK')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
