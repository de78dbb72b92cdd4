"""The control bodies (``shared/protocol/control.py``) as the console and dynamoctl build them: the
wire maps are the ones the worker always received, each action's spec names its body type, and
dynamoctl's subcommands build that body from their arguments."""

from __future__ import annotations

import pytest

from dynamod.console.actions.control import ControlClient
from dynamod.console.actions.specs import ACTIONS, ACTIONS_BY_NAME, LIST_LORAS
from dynamod.console.ctl.main import build_parser
from dynamod.console.tui.asks import ASKS
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol import control
from dynamod.shared.protocol.kv_events import MEDIUM_CPU


@pytest.mark.parametrize(("body", "wire"), [
    (control.DrainRequest(wait=False), {"wait": False, "timeout_s": 300.0}),
    (control.SleepRequest(level=2), {"level": 2}),
    (control.EmptyRequest(), {}),
    (control.ClearKvRequest(), {}),  # no tier: every tier, and no ``medium`` key on the wire
    (control.ClearKvRequest(medium=MEDIUM_CPU), {"medium": MEDIUM_CPU}),
    (control.LoadLoraRequest(lora_name="sql", source=control.LoraSource(uri="file:///a")),
     {"lora_name": "sql", "source": {"uri": "file:///a"}}),
    (control.UnloadLoraRequest(lora_name="sql"), {"lora_name": "sql"}),
])
def test_bodies_encode_to_the_maps_workers_always_received(body: control.ControlBody, wire: dict) -> None:
    assert control.encode_body(body) == wire
    assert control.parse_body(wire, type(body), "x") == body


def test_the_worker_reads_older_and_hand_written_bodies() -> None:
    assert control.parse_body(None, control.DrainRequest, control.DRAIN) == control.DrainRequest(wait=True)
    assert control.parse_body({"lora_name": "a", "source": "/p"}, control.LoadLoraRequest, control.LOAD_LORA).source == "/p"
    assert control.parse_body({"medium": None}, control.ClearKvRequest, control.CLEAR_KV_BLOCKS).medium is None
    with pytest.raises(InvalidRequestError, match="bad sleep request: .*unknown field `lvl`"):
        control.parse_body({"lvl": 2}, control.SleepRequest, control.SLEEP)
    assert control.DrainRequest(timeout_s=5.0).reply_timeout_s() == 5.0 + control.DRAIN_REPLY_SLACK_S
    assert control.SleepRequest().reply_timeout_s() == control.DEFAULT_REPLY_TIMEOUT_S


def test_every_key_action_is_asked_for_in_the_console() -> None:
    assert set(ASKS) == {a.name for a in ACTIONS}


@pytest.mark.parametrize(("argv", "name", "body"), [
    (["drain", "ab"], "drain", control.DrainRequest(wait=False, timeout_s=300.0)),
    (["drain", "ab", "--wait", "--drain-timeout", "5"], "drain", control.DrainRequest(wait=True, timeout_s=5.0)),
    (["sleep", "ab", "--level", "2"], "sleep", control.SleepRequest(level=2)),
    (["wake", "ab"], "wake", control.EmptyRequest()),
    (["clear-kv", "ab"], "clear_kv", control.ClearKvRequest()),
    (["clear-kv", "ab", "--tier", "host"], "clear_kv", control.ClearKvRequest(medium=MEDIUM_CPU)),
    (["lora", "load", "ab", "sql", "file:///a"], "load_lora",
     control.LoadLoraRequest(lora_name="sql", source=control.LoraSource(uri="file:///a"))),
    (["lora", "unload", "ab", "sql"], "unload_lora", control.UnloadLoraRequest(lora_name="sql")),
    (["lora", "list"], "list_loras", control.EmptyRequest()),
])
def test_dynamoctl_subcommands_carry_their_spec_and_build_its_body(argv: list[str], name: str, body: control.ControlBody) -> None:
    args = build_parser().parse_args(argv)
    spec = LIST_LORAS if name == LIST_LORAS.name else ACTIONS_BY_NAME[name]
    assert args.action_spec is spec
    made = args.body_of(args)
    assert isinstance(made, spec.body) and made == body


async def test_run_refuses_a_body_of_another_action() -> None:
    client = ControlClient(None)  # type: ignore[arg-type]  # refused before any cluster call
    with pytest.raises(TypeError, match="sleep takes a SleepRequest, not a DrainRequest"):
        await client.run(ACTIONS_BY_NAME["sleep"], 1, control.DrainRequest())
