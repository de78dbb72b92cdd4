"""etcd discovery (``etcd``): the multi-node backend, on the ``etcd3aio`` gRPC stubs.

Why this module talks to the raw stubs instead of ``etcd3aio``'s helpers: its watch helper skips
compacted history silently and cannot notice an etcd that came back without its data, and its
keep-alive helper gives up on a lost lease. Discovery needs both handled, so we keep our own loops:

* **Leases** are kept alive every ``ttl/3`` by one task per lease. When etcd answers that the lease
  is gone (it was down longer than the TTL, or it lost its data), the lease is re-granted — under
  the *same id* when etcd allows it, so instance ids derived from it stay valid — and every key put
  under it is put again from the store's memory. The ``EtcdLease`` object stays the same; only in
  the rare case that etcd refuses the old id does ``lease.id`` change (logged as a warning), so
  callers should take an instance id from ``lease.id`` once, at registration.
* **Watches** give a snapshot, then changes. After a transient error they reconnect (logged) and
  resume from the last revision seen. If that revision was compacted, or etcd's history diverged
  from what the watcher saw (the server restarted with an empty data dir), the watch re-lists the
  prefix and emits the PUT/DELETE diff, so the watcher's view is right again.
* **Security**: ``https://`` endpoints open a TLS channel verified against ``--etcd-ca-file`` (the
  system roots without one), presenting ``--etcd-cert-file`` when given; with ``--etcd-user`` the
  store logs in first and every call carries etcd's auth token (``etcd_auth``), renewed when etcd
  says it expired.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio
from etcd3aio import prefix_range_end
from etcd3aio._protobuf import (
    DeleteRangeRequest,
    KVStub,
    LeaseGrantRequest,
    LeaseKeepAliveRequest,
    LeaseRevokeRequest,
    LeaseStub,
    PutRequest,
    RangeRequest,
    WatchCreateRequest,
    WatchRequest,
    WatchStub,
)

from dynamod.shared.discovery.etcd_auth import EtcdAuth, auth_hint
from dynamod.shared.discovery.etcd_endpoints import etcd_scheme, format_etcd_endpoint, split_etcd_endpoint
from dynamod.shared.discovery.store import (
    DEFAULT_LEASE_TTL_S,
    KeptAliveLease,
    PrefixListing,
    WatchEvent,
    WatchEventKind,
)
from dynamod.shared.errors import ConfigError, DiscoveryError
from dynamod.shared.security.settings import EtcdSecurity
from dynamod.shared.security.tls import read_pem

logger = logging.getLogger(__name__)

# A restarted etcd must be found again within a fraction of a lease TTL, so gRPC's reconnect
# backoff (default up to 120 s) is capped at 1 s.
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),  # etcd rejects idle pings (too_many_pings)
]
_WATCH_BACKOFF_MIN_S = 0.1
_WATCH_BACKOFF_MAX_S = 2.0
_CLOSE_TIMEOUT_S = 2.0

T = TypeVar("T")


def _ip_family(host: str) -> int | None:
    try:
        return 6 if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address) else 4
    except ValueError:
        return None


class EtcdLease(KeptAliveLease):
    """A lease of this process. ``id`` is stable except when etcd refuses to re-grant it after
    losing it (see the module docstring); ``keys`` is what gets re-put after a re-grant."""

    def __init__(self, store: EtcdStore, lease_id: int, ttl: float) -> None:
        super().__init__(lease_id, ttl)
        self._store = store
        self.needs_reput = False
        self.lock = asyncio.Lock()  # serializes puts with re-grants so no put uses a dead id

    @property
    def grant_ttl(self) -> int:
        """etcd grants whole seconds (and at least its minimum, 2 s on a default server)."""
        return max(1, math.ceil(self._ttl))

    def _set_id(self, lease_id: int) -> None:
        self._id = lease_id

    async def revoke(self) -> None:
        await self._store._revoke(self)


class EtcdStore:
    """Discovery on an etcd v3 cluster. ``endpoints``: ``host:port`` or ``http://host:port``."""

    name = "etcd"

    def __init__(
        self, endpoints: list[str], *, connect_timeout_s: float = 5.0, security: EtcdSecurity | None = None
    ) -> None:
        if not endpoints:
            raise ConfigError("no etcd endpoints given; set --etcd-endpoints or ETCD_ENDPOINTS")
        self._scheme = etcd_scheme(endpoints)
        self._addresses = [split_etcd_endpoint(e) for e in endpoints]
        self.endpoints = [format_etcd_endpoint(h, p, self._scheme) for h, p in self._addresses]
        security = security or EtcdSecurity()
        self._credentials = self._channel_credentials(security)
        self._auth = (
            EtcdAuth(security.user, security.password, max(connect_timeout_s, 1.0))
            if security.user and security.password
            else None
        )
        self._connect_timeout_s = connect_timeout_s
        self._rpc_timeout_s = max(connect_timeout_s, 1.0)
        self._channel: grpc.aio.Channel | None = None
        self._kv: KVStub | None = None
        self._lease_stub: LeaseStub | None = None
        self._watch_stub: WatchStub | None = None
        self._leases: list[EtcdLease] = []
        self._watch_calls: set[Any] = set()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._channel is not None:
            return
        target = await self._target()
        options = [*_CHANNEL_OPTIONS, *self._lb_options()]
        interceptors = self._auth.interceptors() if self._auth is not None else None
        if self._credentials is not None:
            if len(self._addresses) > 1:  # resolved to IPs: the certificate names the first host
                options.append(("grpc.ssl_target_name_override", self._addresses[0][0]))
            self._channel = grpc.aio.secure_channel(target, self._credentials, options=options, interceptors=interceptors)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        self._kv = KVStub(self._channel)
        self._lease_stub = LeaseStub(self._channel)
        self._watch_stub = WatchStub(self._channel)
        try:
            if self._auth is not None:
                self._auth.bind(self._channel)
                await self._auth.login()
            await self._kv.Range(
                RangeRequest(key=b"v1/", range_end=prefix_range_end(b"v1/"), count_only=True),
                timeout=self._connect_timeout_s,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as exc:
            await self._channel.close()
            self._channel = None
            hint = auth_hint(exc)
            if hint:
                raise DiscoveryError(
                    f"etcd at {','.join(self.endpoints)} refused this process: {hint} ({exc.details()})"
                ) from exc
            why = (
                f"no answer within {self._connect_timeout_s:g}s"
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                else f"{exc.code().name}: {exc.details()}"
            )
            tls = (
                "; with https:// check --etcd-ca-file and the server's certificate (and --etcd-cert-file "
                "if etcd requires client certificates)"
                if self._credentials is not None
                else ""
            )
            raise DiscoveryError(
                f"etcd unreachable at {','.join(self.endpoints)} ({why}); start etcd there, point "
                f"--etcd-endpoints/ETCD_ENDPOINTS at it, or use --discovery-backend file on one host{tls}"
            ) from exc
        logger.info(
            "etcd discovery connected endpoints=%s tls=%s user=%s",
            ",".join(self.endpoints),
            self._credentials is not None,
            self._auth.user if self._auth is not None else "-",
        )

    def _channel_credentials(self, security: EtcdSecurity) -> grpc.ChannelCredentials | None:
        """TLS credentials for https:// endpoints; TLS files with http:// ones are a mistake to report."""
        files = security.tls
        if self._scheme != "https":
            if files.any:
                raise ConfigError(
                    "etcd TLS files are set but the etcd endpoints are http://; use https:// endpoints"
                )
            return None
        files.check("etcd")
        if files.cert_file and not files.key_file:
            raise ConfigError("etcd: a client certificate (--etcd-cert-file) needs its key (--etcd-key-file)")
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(files.ca_file, "etcd CA"),
            private_key=read_pem(files.key_file, "etcd client key"),
            certificate_chain=read_pem(files.cert_file, "etcd client certificate"),
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # A caller cancelled while the leases are revoked gets its CancelledError from gather;
            # the watches and the channel are closed all the same.
            await asyncio.gather(*(self._revoke(lease) for lease in list(self._leases)), return_exceptions=True)
        finally:
            for call in list(self._watch_calls):
                call.cancel()
            if self._channel is not None:
                await self._channel.close()
        logger.info("etcd discovery closed endpoints=%s", ",".join(self.endpoints))

    # -- leases ------------------------------------------------------------------------------

    async def create_lease(self, ttl: float = DEFAULT_LEASE_TTL_S) -> EtcdLease:
        self._check_open()
        if ttl <= 0:
            raise DiscoveryError(f"lease ttl must be positive, got {ttl}")
        lease = EtcdLease(self, 0, ttl)
        resp = await self._call(
            "lease grant", self._stubs()[1].LeaseGrant, LeaseGrantRequest(TTL=lease.grant_ttl)
        )
        lease._set_id(resp.ID)
        lease.task = asyncio.create_task(self._keepalive_loop(lease), name=f"etcd-lease-{resp.ID:x}")
        self._leases.append(lease)
        logger.debug("etcd lease granted lease=%016x ttl=%s", resp.ID, resp.TTL)
        return lease

    async def _revoke(self, lease: EtcdLease) -> None:
        if not await lease.retire(self._leases):
            return
        try:
            await self._stubs()[1].LeaseRevoke(
                LeaseRevokeRequest(ID=lease.id), timeout=_CLOSE_TIMEOUT_S, wait_for_ready=True
            )
            logger.debug("etcd lease revoked lease=%016x keys=%d", lease.id, len(lease.keys))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                logger.warning(
                    "etcd lease revoke failed lease=%016x error=%s keys_expire_within_s=%g",
                    lease.id,
                    exc.code().name,
                    lease.ttl,
                )
        lease.keys.clear()

    async def _keepalive_loop(self, lease: EtcdLease) -> None:
        """Renews every ttl/3; while etcd is unreachable retries faster so that a restarted etcd
        sees the renewal before the lease it restored expires."""
        interval = lease.ttl / 3
        failing_since: float | None = None
        loop = asyncio.get_running_loop()
        while not lease.revoked:
            await asyncio.sleep(interval if failing_since is None else min(interval, 0.5))
            try:
                remaining = await self._keepalive_once(lease.id, timeout=max(interval, 0.5))
                if remaining <= 0 or lease.needs_reput:
                    async with lease.lock:
                        if not lease.revoked:
                            await self._regrant_locked(lease, lost=remaining <= 0)
            except (grpc.aio.AioRpcError, TimeoutError, DiscoveryError) as exc:
                if self._auth is not None and await self._auth.refresh_if_stale(exc):
                    continue
                if failing_since is None:
                    failing_since = loop.time()
                    logger.warning(
                        "etcd lease keepalive failing lease=%016x error=%s endpoints=%s",
                        lease.id,
                        _describe(exc),
                        ",".join(self.endpoints),
                    )
                continue
            if failing_since is not None:
                logger.info(
                    "etcd lease keepalive recovered lease=%016x after_s=%.1f",
                    lease.id,
                    loop.time() - failing_since,
                )
                failing_since = None

    async def _keepalive_once(self, lease_id: int, timeout: float) -> int:
        """One renewal on a short-lived stream; returns the TTL left (0: etcd no longer has it)."""

        async def one_request() -> AsyncIterator[Any]:
            yield LeaseKeepAliveRequest(ID=lease_id)

        call = self._stubs()[1].LeaseKeepAlive(one_request(), timeout=timeout, wait_for_ready=True)
        try:
            resp = await call.read()
        finally:
            call.cancel()
        if resp is grpc.aio.EOF:
            raise DiscoveryError("etcd closed the keepalive stream without an answer")
        return int(resp.TTL)

    async def _regrant_locked(self, lease: EtcdLease, *, lost: bool = True) -> None:
        """Re-grants a lost lease (same id if etcd allows) and re-puts its keys. Holds lease.lock."""
        kv, lease_stub, _ = self._stubs()
        old_id = lease.id
        if lost:
            try:
                await self._raw(lease_stub.LeaseGrant, LeaseGrantRequest(TTL=lease.grant_ttl, ID=old_id))
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:  # "lease already exists"
                    raise
                resp = await self._raw(lease_stub.LeaseGrant, LeaseGrantRequest(TTL=lease.grant_ttl))
                lease._set_id(resp.ID)
                logger.warning(
                    "etcd lease id changed old_lease=%016x new_lease=%016x reason=old_id_taken", old_id, resp.ID
                )
        lease.needs_reput = True
        for key, value in list(lease.keys.items()):
            await self._raw(kv.Put, PutRequest(key=key.encode(), value=value, lease=lease.id))
        lease.needs_reput = False
        logger.warning(
            "etcd lease %s lease=%016x old_lease=%016x keys_reput=%d",
            "re-granted" if lost else "keys re-put",
            lease.id,
            old_id,
            len(lease.keys),
        )

    # -- key/value ---------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, lease: EtcdLease | None = None) -> None:  # type: ignore[override]
        self._check_open()
        _check_key(key)
        kv = self._stubs()[0]
        if lease is None:
            await self._call(f"put {key}", kv.Put, PutRequest(key=key.encode(), value=value))
        else:
            if lease.revoked or lease._store is not self:
                raise DiscoveryError(
                    f"lease {lease.id:x} was revoked or belongs to another store; cannot put {key}"
                )
            async with lease.lock:
                try:
                    await self._raw(kv.Put, PutRequest(key=key.encode(), value=value, lease=lease.id))
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:  # "requested lease not found"
                        raise self._error(f"put {key}", exc) from exc
                    try:
                        await self._regrant_locked(lease)
                        await self._raw(kv.Put, PutRequest(key=key.encode(), value=value, lease=lease.id))
                    except grpc.aio.AioRpcError as exc2:
                        raise self._error(f"put {key}", exc2) from exc2
                lease.keys[key] = value
        self._forget_key(key, keep=lease)

    async def delete(self, key: str) -> None:
        self._check_open()
        await self._call(f"delete {key}", self._stubs()[0].DeleteRange, DeleteRangeRequest(key=key.encode()))
        self._forget_key(key, keep=None)

    async def get(self, key: str) -> bytes | None:
        self._check_open()
        resp = await self._call(f"get {key}", self._stubs()[0].Range, RangeRequest(key=key.encode()))
        return bytes(resp.kvs[0].value) if resp.kvs else None

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        self._check_open()
        kvs, _ = await self._list(prefix)
        return {k: v for k, (v, _rev) in kvs.items()}

    async def list_prefix(self, prefix: str) -> PrefixListing:
        self._check_open()
        kvs, revision = await self._list(prefix)
        items = {k: v for k, (v, _rev) in kvs.items()}
        return PrefixListing(prefix, items, revision, {k: rev for k, (_v, rev) in kvs.items()})

    # -- watch -------------------------------------------------------------------------------

    async def watch_prefix(  # type: ignore[override]
        self, prefix: str, *, after: PrefixListing | None = None
    ) -> AsyncIterator[WatchEvent]:
        self._check_open()
        view: dict[str, tuple[bytes, int]] = {}  # key -> (value, mod_revision) as the watcher saw it
        if after is not None:
            # Resumes from the listing's revision; the loop's first check re-lists and sends the
            # difference when etcd's history no longer holds it (compacted, data lost).
            view = {k: (v, after.versions.get(k, 0)) for k, v in after.items.items()}
            last_rev = after.revision
        else:
            listed = await self._list_until_ok(prefix)
            if listed is None:
                return
            kvs, last_rev = listed
            for key in sorted(kvs):
                view[key] = kvs[key]
                yield WatchEvent(WatchEventKind.PUT, key, kvs[key][0])

        backoff = _WATCH_BACKOFF_MIN_S
        lost_at: float | None = None
        loop = asyncio.get_running_loop()
        resync_reason = ""
        while not self._closed:
            # Also before the first stream: the consumer may have parked us after the snapshot
            # for as long as it liked, and etcd may have lost its data meanwhile.
            reconciled = await self._reconcile(prefix, view, last_rev, resync_reason)
            if reconciled is None:
                return
            events, view, last_rev = reconciled
            for ev in events:
                yield ev
            resync_reason = ""
            call = self._stubs()[2].Watch(_watch_requests(prefix, last_rev + 1), wait_for_ready=True)
            self._watch_calls.add(call)
            try:
                async for resp in call:
                    if resp.compact_revision:
                        resync_reason = f"history compacted up to revision {resp.compact_revision}"
                        break
                    if resp.canceled:
                        resync_reason = f"watch canceled by etcd ({resp.cancel_reason or 'no reason'})"
                        break
                    if 0 < resp.header.revision < last_rev:
                        resync_reason = (
                            f"etcd revision went back from {last_rev} to {resp.header.revision} (data lost)"
                        )
                        break
                    if resp.created:
                        if lost_at is not None:
                            logger.info(
                                "etcd watch resumed prefix=%s from_revision=%d after_s=%.1f",
                                prefix,
                                last_rev + 1,
                                loop.time() - lost_at,
                            )
                            lost_at = None
                        backoff = _WATCH_BACKOFF_MIN_S
                        continue
                    for ev in resp.events:
                        key = bytes(ev.kv.key).decode(errors="replace")
                        last_rev = max(last_rev, ev.kv.mod_revision)
                        if ev.type == ev.PUT:
                            value = bytes(ev.kv.value)
                            view[key] = (value, ev.kv.mod_revision)
                            yield WatchEvent(WatchEventKind.PUT, key, value)
                        elif view.pop(key, None) is not None:
                            yield WatchEvent(WatchEventKind.DELETE, key)
                    if not resp.events:  # progress notification
                        last_rev = max(last_rev, resp.header.revision)
                else:
                    if not self._closed:
                        raise _StreamEnded()
            except (grpc.aio.AioRpcError, _StreamEnded) as exc:
                if self._closed:
                    return
                if self._auth is not None:
                    await self._auth.refresh_if_stale(exc)  # the next stream carries a fresh token
                if lost_at is None:
                    lost_at = loop.time()
                    logger.warning(
                        "etcd watch lost prefix=%s error=%s endpoints=%s; reconnecting",
                        prefix,
                        _describe(exc),
                        ",".join(self.endpoints),
                    )
            except asyncio.CancelledError:
                # close() cancels the gRPC call, which surfaces here as CancelledError; a real
                # cancellation of the consumer's task must propagate.
                task = asyncio.current_task()
                if self._closed and task is not None and task.cancelling() == 0:
                    return
                raise
            finally:
                call.cancel()
                self._watch_calls.discard(call)
            if self._closed:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _WATCH_BACKOFF_MAX_S)

    # -- internals ---------------------------------------------------------------------------

    async def _range(self, prefix: str, revision: int = 0) -> tuple[dict[str, tuple[bytes, int]], int]:
        """Keys under ``prefix`` (at ``revision``, 0 = now) with their mod_revision; raw gRPC errors."""
        key = prefix.encode()
        req = RangeRequest(key=key, range_end=prefix_range_end(key) if key else b"\x00", revision=revision)
        resp = await self._raw(self._stubs()[0].Range, req)
        kvs = {
            bytes(kv.key).decode(errors="replace"): (bytes(kv.value), int(kv.mod_revision)) for kv in resp.kvs
        }
        return kvs, int(resp.header.revision)

    async def _list(self, prefix: str) -> tuple[dict[str, tuple[bytes, int]], int]:
        try:
            return await self._range(prefix)
        except grpc.aio.AioRpcError as exc:
            raise self._error(f"get_prefix {prefix}", exc) from exc

    async def _list_until_ok(self, prefix: str) -> tuple[dict[str, tuple[bytes, int]], int] | None:
        """Lists ``prefix``, retrying while etcd is unreachable; None once the store is closed."""
        delay = _WATCH_BACKOFF_MIN_S
        logged = False
        while not self._closed:
            try:
                return await self._list(prefix)
            except DiscoveryError as exc:
                if self._closed:
                    break
                if not logged:
                    logger.warning("etcd watch cannot list prefix=%s error=%s; retrying", prefix, exc)
                    logged = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, _WATCH_BACKOFF_MAX_S)
        return None

    async def _reconcile(
        self, prefix: str, view: dict[str, tuple[bytes, int]], last_rev: int, reason: str
    ) -> tuple[list[WatchEvent], dict[str, tuple[bytes, int]], int] | None:
        """Before a watch resumes at ``last_rev + 1``: checks that etcd's history still holds the
        watcher's view at ``last_rev`` (exactly, with mod_revisions). If it does, replaying from
        there is right. If not — compacted, a revision etcd no longer reaches, or different
        content (etcd restarted with another data dir) — re-lists and returns the diff events.
        Retries while etcd is unreachable; None once the store is closed."""
        delay = _WATCH_BACKOFF_MIN_S
        logged = False
        while not self._closed:
            try:
                if not reason:
                    try:
                        at_last, _ = await self._range(prefix, revision=last_rev)
                        if at_last != view:
                            reason = f"etcd history at revision {last_rev} differs from what the watch saw (data lost)"
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.OUT_OF_RANGE:  # compacted / future revision
                            raise
                        reason = exc.details() or "revision out of range"
                if not reason:
                    return [], view, last_rev
                kvs, now_rev = await self._range(prefix)
                logger.warning("etcd watch resync prefix=%s reason=%s revision=%d", prefix, reason, now_rev)
                return _diff(view, kvs), dict(kvs), now_rev
            except grpc.aio.AioRpcError as exc:
                if self._closed:
                    break
                if not logged:
                    logger.warning(
                        "etcd watch cannot reconcile prefix=%s error=%s; retrying", prefix, _describe(exc)
                    )
                    logged = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, _WATCH_BACKOFF_MAX_S)
        return None

    async def _raw(self, method: Callable[..., Awaitable[T]], request: Any) -> T:
        return await method(request, timeout=self._rpc_timeout_s, wait_for_ready=True)

    async def _call(self, what: str, method: Callable[..., Awaitable[T]], request: Any) -> T:
        try:
            return await self._raw(method, request)
        except grpc.aio.AioRpcError as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: grpc.aio.AioRpcError) -> DiscoveryError:
        return DiscoveryError(f"etcd {what} failed at {','.join(self.endpoints)}: {_describe(exc)}")

    def _stubs(self) -> tuple[KVStub, LeaseStub, WatchStub]:
        if self._kv is None or self._lease_stub is None or self._watch_stub is None:
            raise DiscoveryError("etcd discovery store is not started; call start() first")
        return self._kv, self._lease_stub, self._watch_stub

    def _check_open(self) -> None:
        if self._closed:
            raise DiscoveryError("etcd discovery store is closed")
        self._stubs()

    def _forget_key(self, key: str, keep: EtcdLease | None) -> None:
        """A key belongs to at most one lease: the last put wins, as in etcd itself."""
        for lease in self._leases:
            if lease is not keep:
                lease.keys.pop(key, None)

    @staticmethod
    def _fmt(host: str, port: int) -> str:
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _lb_options(self) -> list[tuple[str, Any]]:
        return [("grpc.lb_policy_name", "round_robin")] if len(self._addresses) > 1 else []

    async def _target(self) -> str:
        """One endpoint: gRPC's DNS resolver. Several: a static address list (gRPC cannot take a
        list of names), so names are resolved once here."""
        if len(self._addresses) == 1:
            host, port = self._addresses[0]
            return f"dns:///{self._fmt(host, port)}"
        loop = asyncio.get_running_loop()
        v4: list[str] = []
        v6: list[str] = []
        for host, port in self._addresses:
            family = _ip_family(host)
            if family == 4:
                v4.append(f"{host}:{port}")
            elif family == 6:
                v6.append(f"[{host}]:{port}")
            else:
                try:
                    infos = await loop.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
                except OSError as exc:
                    raise DiscoveryError(f"etcd endpoint {host}:{port} does not resolve: {exc}") from exc
                v4.extend(sorted({f"{info[4][0]}:{port}" for info in infos}))
        if v4 and v6:
            raise ConfigError("etcd endpoints mix IPv4 and IPv6 addresses; use one family")
        return f"ipv4:{','.join(v4)}" if v4 else f"ipv6:{','.join(v6)}"


class _StreamEnded(Exception):
    """The server ended a watch stream without an error (e.g. it is shutting down)."""

    def __str__(self) -> str:
        return "stream ended by server"


def _check_key(key: str) -> None:
    if not key:
        raise DiscoveryError("discovery keys must be non-empty")


async def _watch_requests(prefix: str, start_revision: int) -> AsyncIterator[Any]:
    key = prefix.encode()
    yield WatchRequest(
        create_request=WatchCreateRequest(
            key=key, range_end=prefix_range_end(key) if key else b"\x00", start_revision=start_revision
        )
    )
    await asyncio.Event().wait()  # keep the request side open: closing it ends the watch


def _diff(old: dict[str, tuple[bytes, int]], new: dict[str, tuple[bytes, int]]) -> list[WatchEvent]:
    events = [WatchEvent(WatchEventKind.DELETE, k) for k in sorted(old.keys() - new.keys())]
    for key in sorted(new):
        if key not in old or old[key] != new[key]:
            events.append(WatchEvent(WatchEventKind.PUT, key, new[key][0]))
    return events


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
