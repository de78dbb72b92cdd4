"""CURVE keys from the cluster token and the ZAP handler's answers, without sockets."""

from __future__ import annotations

import logging

import pytest
import zmq
import zmq.asyncio
from zmq.utils import z85

from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.events.factory import make_event_plane
from dynamod.shared.security.curve import CurveKeys, event_plane_curve
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.security.tls import TlsFiles
from dynamod.shared.security.token import ClusterToken
from dynamod.shared.security.zmq_gate import CurveGate

TOKEN = ClusterToken("member-token-0123456789abcdef")


def test_every_member_derives_the_same_keys_and_other_tokens_do_not() -> None:
    a, b = CurveKeys.from_token(TOKEN), CurveKeys.from_token(ClusterToken(TOKEN.value))
    assert a == b
    other = CurveKeys.from_token(ClusterToken("another-cluster-token-0123456789"))
    assert {a.server_public, a.client_public}.isdisjoint({other.server_public, other.client_public})
    assert a.server_public != a.client_public  # independent server and client pairs
    # The public keys are the Curve25519 publics of the secrets (libzmq would refuse otherwise).
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert len(z85.decode(a.client_secret)) == 32


def test_repr_shows_no_secret() -> None:
    keys = CurveKeys.from_token(TOKEN)
    text = repr(keys)
    assert keys.server_secret.decode() not in text and keys.client_secret.decode() not in text
    assert TOKEN.value not in text


def test_curve_is_on_exactly_with_a_token() -> None:
    assert event_plane_curve(None) is None
    assert event_plane_curve(TOKEN) == CurveKeys.from_token(TOKEN)


def _zap(mechanism: bytes, *credentials: bytes) -> list[bytes]:
    return [b"1.0", b"req-7", b"dynamod-events", b"10.1.2.3", b"", mechanism, *credentials]


@pytest.fixture
def gate() -> CurveGate:
    return CurveGate(zmq.asyncio.Context.instance(), CurveKeys.from_token(TOKEN))


def test_gate_admits_the_member_client_key(gate: CurveGate) -> None:
    member = z85.decode(CurveKeys.from_token(TOKEN).client_public)
    reply = gate.answer(_zap(b"CURVE", member))
    assert reply[:3] == [b"1.0", b"req-7", b"200"]
    assert (gate.admitted, gate.rejected) == (1, 0)


@pytest.mark.parametrize(
    "request_frames",
    [
        _zap(b"CURVE", z85.decode(CurveKeys.from_token(ClusterToken("x" * 24)).client_public)),
        _zap(b"NULL"),
        _zap(b"PLAIN", b"user", b"pass"),
        _zap(b"CURVE", b"short"),
    ],
    ids=["unknown_key", "null", "plain", "bad_key_length"],
)
def test_gate_refuses_everyone_else(gate: CurveGate, request_frames: list[bytes], caplog) -> None:
    with caplog.at_level(logging.WARNING):
        reply = gate.answer(request_frames)
    assert reply[1:3] == [b"req-7", b"400"]
    assert reply[4] == b""  # no user id on a refusal
    assert gate.rejected == 1
    assert "peer=10.1.2.3" in caplog.text


def test_gate_answers_a_malformed_request(gate: CurveGate) -> None:
    assert gate.answer([b"1.0", b"id"])[1:3] == [b"id", b"400"]
    assert gate.answer([b"9.9", b"id", b"d", b"a", b"", b"CURVE", b"k" * 32])[2] == b"400"


async def test_factory_turns_curve_on_with_the_cluster_token() -> None:
    store = MemStore()
    lease = await store.create_lease(10.0)
    with_token = make_event_plane("zmq", store=store, lease=lease, membership=RequestPlaneSecurity(token=TOKEN))
    assert with_token.curve == CurveKeys.from_token(TOKEN)
    assert make_event_plane("zmq", store=store, lease=lease).curve is None


async def test_factory_warns_when_tls_is_on_but_events_stay_open(tmp_path, caplog) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("unused here")
    store = MemStore()
    lease = await store.create_lease(10.0)
    with caplog.at_level(logging.WARNING):
        plane = make_event_plane(
            "zmq", store=store, lease=lease, membership=RequestPlaneSecurity(tls=TlsFiles(ca_file=str(ca)))
        )
    assert plane.curve is None
    assert "event plane zmq is not authenticated" in caplog.text
