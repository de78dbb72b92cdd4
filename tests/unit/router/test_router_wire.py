"""The routing wire types in shared/protocol encode to the very bytes the daemons sent before
they were structs (dicts built by hand, structs defined in daemon/), and decode what was sent."""

from __future__ import annotations

import msgspec

from dynamod.shared.kv.router_sync import SequenceFreed, encode_sequence_event
from dynamod.shared.protocol.best_worker import BestWorkerAnswer, BestWorkerRequest
from dynamod.shared.protocol.replica_sync import SyncEnvelope, sync_envelope_decoder, sync_envelope_encoder
from dynamod.shared.protocol.routing import (
    CandidateScore,
    DisaggInfo,
    PublishedDecision,
    RoutingDecision,
    published_decision_decoder,
    published_decision_encoder,
)
from dynamod.shared.protocol.worker_health import (
    KIND_WORKER_DOWN,
    RoutingNotice,
    routing_notice_decoder,
    routing_notice_encoder,
)


def decision(**kw: object) -> RoutingDecision:
    fields: dict[str, object] = dict(
        request_id="r1", worker_id=0xA, dp_rank=1, overlap_blocks=2, request_blocks=4, isl=70,
        reason="lowest_cost", detail="cost 3.5 < 4.0", overlap_weight=1.0, temperature=0.0,
        candidates=[CandidateScore(0xA, 1, 2, 6, 0.375, 3, 3.375, 9), CandidateScore(0xB, 0, 0, 70, 4.375, 1, 5.375, 2, 0.25)],
        busy=[(0xC, 0, "kv usage 0.97")],
    )
    fields.update(kw)
    return RoutingDecision(**fields)  # type: ignore[arg-type]


def test_published_decision_bytes_match_the_dict_the_publisher_built() -> None:
    for d in (decision(), decision(stage="decode", disagg=DisaggInfo(mode="remote", policy="always", reason="always"))):
        for model in ("", "llama"):
            body = d.to_dict()
            body["ts"] = 1700000000.25
            body["source"] = "frontend"
            body["router_instance_id"] = "1f"
            if model:
                body["model"] = model
            sent = published_decision_encoder.encode(
                PublishedDecision.of(d, ts=1700000000.25, source="frontend", router_instance_id="1f", model=model)
            )
            assert sent == msgspec.msgpack.encode(body)
            back = published_decision_decoder.decode(sent)
            assert back.model == (model or msgspec.UNSET)
            assert msgspec.convert(msgspec.msgpack.decode(sent), RoutingDecision) == d  # readers of the plain decision


def test_published_decision_decodes_a_message_without_its_envelope_fields() -> None:
    back = published_decision_decoder.decode(msgspec.msgpack.encode(decision().to_dict()))
    assert (back.ts, back.source, back.router_instance_id, back.model) == (0.0, "", "", msgspec.UNSET)
    assert back.worker == (0xA, 1)


def test_best_worker_answer_bytes_match_the_dict_the_router_built() -> None:
    d = decision()
    old = {"worker_id": d.worker_id, "dp_rank": d.dp_rank, "overlap_blocks": d.overlap_blocks, "explain": d.to_dict()}
    assert msgspec.msgpack.encode(BestWorkerAnswer.of(d)) == msgspec.msgpack.encode(old)


def test_best_worker_request_from_a_map() -> None:
    req = msgspec.convert({"token_ids": [1, 2, 3], "stage": "prefill"}, BestWorkerRequest)
    assert req == BestWorkerRequest(token_ids=[1, 2, 3], stage="prefill")


def test_sync_envelope_roundtrip_and_layout() -> None:
    raw = encode_sequence_event(SequenceFreed(router_id=3, request_id="r1"))
    sent = sync_envelope_encoder.encode(SyncEnvelope(model="backend", events=[raw]))
    assert msgspec.msgpack.decode(sent) == {"model": "backend", "events": [raw]}
    assert sync_envelope_decoder.decode(sent).events == [raw]


def test_routing_notice_layout_omits_defaults() -> None:
    sent = routing_notice_encoder.encode(RoutingNotice(sender=9, kind=KIND_WORKER_DOWN, worker_id=0x2A))
    assert msgspec.msgpack.decode(sent) == {"sender": 9, "kind": "worker_down", "worker_id": 0x2A}
    assert msgspec.msgpack.decode(routing_notice_encoder.encode(RoutingNotice(sender=9, kind="x"))) == {"sender": 9, "kind": "x"}
    assert routing_notice_decoder.decode(sent).worker_id == 0x2A
