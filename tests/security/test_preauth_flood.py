"""Unauthenticated connections cannot lock members out (issue 25, item 2).

A real worker with a cluster token and ``--request-plane-max-connections 20`` holds 40 idle TCP
connections that never present the token; fresh authenticated clients (each a new connection, as a
``dynamoctl`` run or a restarted frontend is) still drain, wake and generate, the idle ones are
closed (oldest first, then at the handshake deadline) and the worker's descriptors stay bounded.
The KV block server gets the same slots table: a flood of silent readers does not keep a reader
with the token out.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamod.console.actions.control import ControlClient
from dynamod.console.actions.specs import ACTIONS_BY_NAME as ACT
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.tcp_server import KvBlockServer
from dynamod.shared.kv.transfer.tcp_wire import LENGTH, HelloRequest, OkReply, encode_frame, reply_decoder
from dynamod.shared.protocol import control
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.security.token import ClusterToken
from dynamod.shared.transport.admission import PreAuthLimits
from tests.fixtures.daemons import DaemonProcess, file_cluster_env
from tests.security.frontend_abuse_support import closed_by_server

pytestmark = pytest.mark.timeout(120)

TOKEN = "t0ken-for-the-flood-test-0123456789"


def _open_idle(host: str, port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection((host, port), timeout=5)
        socks.append(s)
    return socks


async def _until(done, timeout_s: float) -> None:  # noqa: ANN001
    """Polls ``done`` until true or ``timeout_s`` passed (the assertion after it says which)."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:  # noqa: ASYNC110 - a condition, not an event
        await asyncio.sleep(0.05)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_idle_unauthenticated_connections_leave_room_for_members(tmp_path: Path) -> None:
    kv_dir = tmp_path / "kv"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    env = file_cluster_env(kv_dir, DYN_LEASE_TTL="3", DYN_CLUSTER_TOKEN_FILE=str(token_file))
    worker = DaemonProcess(
        ["--role", "agg", "--engine", "mocker", "--model", "tiny", "--speedup-ratio", "50",
         "--request-plane-max-connections", "20", "--request-plane-handshake-timeout", "2"],
        env=env, log_dir=str(tmp_path),
    )
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(kv_dir), event_plane="zmq", lease_ttl_s=3.0)
    object.__setattr__(settings, "security", _token_security())
    rt = await DistributedRuntime.create(settings)
    idle: list[socket.socket] = []
    try:
        client = await rt.namespace().component("backend").endpoint("generate").client()
        await client.wait_for_instances(1, timeout=30)
        inst = client.instances[0]
        await client.close()
        host, port = inst.address.rsplit(":", 1)
        fds_before = _fds(worker.pid)
        idle = await asyncio.to_thread(_open_idle, host, int(port), 40)

        # Six operator actions, each on a connection of its own (a new runtime), as dynamoctl runs are.
        started = time.monotonic()
        for _ in range(3):
            fresh = await DistributedRuntime.create(settings, events=False)
            ctl = ControlClient(fresh, namespace="dynamo")
            try:
                assert (await ctl.run(ACT["drain"], inst.instance_id, control.DrainRequest(wait=False))).ok
                assert (await ctl.run(ACT["wake"], inst.instance_id, control.EmptyRequest())).ok
            finally:
                await ctl.close()
                await fresh.shutdown(0)
        assert time.monotonic() - started < 20
        # The real CLI too, with the token from its file.
        res = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(kv_dir), "drain", f"{inst.instance_id:x}"],
            capture_output=True, text=True, timeout=60, env={**os.environ, "DYN_CLUSTER_TOKEN_FILE": str(token_file)},
        )
        assert res.returncode == 0 and "draining" in res.stdout, res
        res = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(kv_dir), "wake", f"{inst.instance_id:x}"],
            capture_output=True, text=True, timeout=60, env={**os.environ, "DYN_CLUSTER_TOKEN_FILE": str(token_file)},
        )
        assert res.returncode == 0, res

        # Every idle connection is gone within the handshake deadline; descriptors back to bounded.
        await _until(lambda: all(closed_by_server(s) for s in idle), 10)
        still = [s.getsockname() for s in idle if not closed_by_server(s)]
        assert not still, (len(still), worker.log()[-3000:])
        assert _fds(worker.pid) <= fds_before + 8
    finally:
        for s in idle:
            s.close()
        worker.kill()
        await rt.shutdown(0)


def _token_security():
    from dynamod.shared.security.settings import SecuritySettings

    return SecuritySettings(request_plane=RequestPlaneSecurity(token=ClusterToken(TOKEN)))


async def _hello(port: int) -> object:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(encode_frame(HelloRequest(auth=TOKEN)))
        await writer.drain()
        (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        return reply_decoder.decode(await reader.readexactly(length))
    finally:
        writer.close()


async def test_kv_block_server_keeps_room_for_readers_with_the_token() -> None:
    server = KvBlockServer(
        KvBlockMemory(4, 64), "a0", "127.0.0.1", 0,
        security=RequestPlaneSecurity(token=ClusterToken(TOKEN)), max_connections=8, pre_auth=PreAuthLimits(2, 2),
    )
    await server.start()
    idle = []
    try:
        for _ in range(30):
            idle.append(await asyncio.open_connection("127.0.0.1", server.port))
        await _until(lambda: server.admission.pending <= 2, 10)
        assert server.admission.evicted >= 28
        for _ in range(5):
            assert isinstance(await asyncio.wait_for(_hello(server.port), 5), OkReply)
    finally:
        for _, w in idle:
            w.close()
        await server.close()


async def test_token_guessing_on_the_request_plane_is_cut_off_per_address() -> None:
    import msgspec

    from dynamod.shared.transport.framing import CONNECTION_STREAM_ID, HEADER, ClientFrame
    from dynamod.shared.transport.tcp_client import TcpRequestClient
    from dynamod.shared.transport.tcp_server import TcpRequestServer

    security = RequestPlaneSecurity(token=ClusterToken(TOKEN))
    server = TcpRequestServer(security=security)

    async def echo(body, ctx):  # noqa: ANN001, ANN202
        yield body

    server.register("ns/c/echo", echo)
    address = await server.start()
    host, port = address.address.rsplit(":", 1)

    async def guess(i: int) -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.9", 0))
        payload = msgspec.msgpack.encode(ClientFrame(CONNECTION_STREAM_ID, auth=f"guess-{i:04d}-0123456789abcdef"))
        writer.write(HEADER.pack(len(payload)) + payload)
        try:
            async with asyncio.timeout(5):
                return await reader.read()
        except (ConnectionError, OSError):
            return b""
        finally:
            writer.close()

    try:
        answers = [await guess(i) for i in range(20)]
        assert all(answers[:10]) and not any(answers[11:]), [len(a) for a in answers]  # told, then cut unread
        client = TcpRequestClient(security=security)
        try:  # a member on another address is served
            assert [x async for x in client.stream(address, "ns/c/echo", "hi", timeout_s=10)] == ["hi"]
        finally:
            await client.close()
    finally:
        await server.stop(grace_s=0)
