"""etcd's user/password login for the raw gRPC stubs of ``EtcdStore``.

etcd hands out a token for a user (``Auth.Authenticate``) that every later call carries as ``token``
metadata; the token expires (simple tokens after ``--auth-token-ttl`` of disuse, JWTs after their
TTL), after which etcd answers ``invalid auth token``. ``EtcdAuth`` holds the current token, logs in
again when told the token went stale (once, however many calls noticed at the same moment), and
its interceptors put the token on every call and retry a unary call once after a fresh login.
Streaming calls (watch, lease keep-alive) cannot be replayed by an interceptor: their loops call
``refresh_if_stale`` with the error they saw and open a new stream, which then carries the new token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
from etcd3aio._protobuf import AuthenticateRequest, AuthStub

from dynamod.shared.errors import DiscoveryError

logger = logging.getLogger(__name__)

_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"


def token_invalid(exc: BaseException) -> bool:
    """etcd's answer to an expired or revoked token (``ErrGRPCInvalidAuthToken``)."""
    return (
        isinstance(exc, grpc.aio.AioRpcError)
        and exc.code() == grpc.StatusCode.UNAUTHENTICATED
        and "invalid auth token" in (exc.details() or "")
    )


def auth_hint(exc: grpc.aio.AioRpcError) -> str:
    """What to do about an auth failure, for the one line the operator reads; '' if not one."""
    details = exc.details() or ""
    if "user name is empty" in details:
        return "etcd has auth enabled: set --etcd-user and --etcd-password-file (or a client certificate)"
    if "authentication failed" in details:
        return "etcd refused the user or password (--etcd-user, --etcd-password-file)"
    if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
        return (
            "the etcd user (without --etcd-user: the client certificate's common name) lacks "
            "read/write permission on the v1/ prefix"
        )
    return ""


class EtcdAuth:
    """The login of one store: its token and how to renew it."""

    def __init__(self, user: str, password: str, timeout_s: float) -> None:
        self.user = user
        self._password = password
        self._timeout_s = timeout_s
        self._stub: AuthStub | None = None
        self._token: str | None = None
        self._generation = 0
        self._lock = asyncio.Lock()

    def bind(self, channel: grpc.aio.Channel) -> None:
        self._stub = AuthStub(channel)

    @property
    def token(self) -> str | None:
        return self._token

    async def login(self) -> None:
        if self._stub is None:
            raise DiscoveryError("etcd auth is not bound to a channel")
        resp = await self._stub.Authenticate(
            AuthenticateRequest(name=self.user, password=self._password),
            timeout=self._timeout_s,
            wait_for_ready=True,
        )
        self._token = resp.token
        self._generation += 1
        logger.debug("etcd login user=%s generation=%d", self.user, self._generation)

    async def refresh(self, seen_generation: int) -> None:
        """Logs in again unless someone already did since ``seen_generation``."""
        async with self._lock:
            if self._generation == seen_generation:
                logger.info("etcd auth token expired; logging in again user=%s", self.user)
                await self.login()

    async def refresh_if_stale(self, exc: BaseException) -> bool:
        """For streaming loops: True when ``exc`` meant a stale token and a new one was fetched."""
        if not token_invalid(exc):
            return False
        try:
            await self.refresh(self._generation)
        except grpc.aio.AioRpcError as login_exc:
            logger.warning("etcd login failed user=%s error=%s", self.user, login_exc.details())
            return False
        return True

    def _details(self, details: grpc.aio.ClientCallDetails) -> tuple[grpc.aio.ClientCallDetails, int]:
        generation = self._generation
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if self._token is None or method == _AUTHENTICATE:
            return details, generation
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata["token"] = self._token
        return (
            grpc.aio.ClientCallDetails(
                details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
            ),
            generation,
        )

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        return [_UnaryUnary(self), _UnaryStream(self), _StreamUnary(self), _StreamStream(self)]


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, auth: EtcdAuth) -> None:
        self._auth = auth

    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        call_details, generation = self._auth._details(details)
        call = await continuation(call_details, request)
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            if not token_invalid(exc):
                raise
        await self._auth.refresh(generation)
        call_details, _ = self._auth._details(details)
        return await (await continuation(call_details, request))


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, auth: EtcdAuth) -> None:
        self._auth = auth

    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._auth._details(details)[0], request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, auth: EtcdAuth) -> None:
        self._auth = auth

    async def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._auth._details(details)[0], requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, auth: EtcdAuth) -> None:
        self._auth = auth

    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._auth._details(details)[0], requests)
