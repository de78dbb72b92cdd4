"""A stand-in for ControlClient that records calls, for Pilot tests of the key/confirm/result flow
(the live tests in test_console_live.py drive the real one against real workers)."""

from __future__ import annotations

from dynamod.console.actions.control import ActionResult
from dynamod.console.actions.specs import ActionSpec
from dynamod.shared.protocol import control
from dynamod.shared.protocol.worker_id import worker_id_hex

# What a worker would answer each action with, from the body it was sent.
MESSAGES = {
    "drain": lambda body: "draining",
    "sleep": lambda body: f"sleeping at level {body.level}",
    "wake": lambda body: "awake",
    "clear_kv": lambda body: "cleared 12 cached blocks",
    "load_lora": lambda body: f"loaded {body.lora_name}",
    "unload_lora": lambda body: f"unloaded {body.lora_name}",
}


class FakeControl:
    def __init__(self, *, fail: str | None = None) -> None:
        self.calls: list[tuple[str, int, control.ControlBody]] = []
        self.fail = fail

    async def run(self, spec: ActionSpec, target: int, body: control.ControlBody) -> ActionResult:
        assert isinstance(body, spec.body), f"{spec.name} sent a {type(body).__name__}"
        self.calls.append((spec.name, target, body))
        if self.fail:
            return ActionResult(spec.verb, worker_id_hex(target), False, self.fail)
        return ActionResult(spec.verb, worker_id_hex(target), True, MESSAGES[spec.name](body))

    async def close(self) -> None:
        return None
