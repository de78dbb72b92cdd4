"""A stand-in for ControlClient that records calls, for Pilot tests of the key/confirm/result flow
(the live tests in test_console_live.py drive the real one against real workers)."""

from __future__ import annotations

from dynamod.console.actions.control import ActionResult
from dynamod.shared.protocol.worker_id import worker_id_hex


class FakeControl:
    def __init__(self, *, fail: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def _result(self, action: str, target: int, message: str) -> ActionResult:
        if self.fail:
            return ActionResult(action, worker_id_hex(target), False, self.fail)
        return ActionResult(action, worker_id_hex(target), True, message)

    async def drain(self, target: int, *, wait: bool = False, timeout_s: float = 300.0) -> ActionResult:
        self.calls.append(("drain", target))
        return self._result("drain", target, "draining")

    async def sleep(self, target: int, level: int = 1) -> ActionResult:
        self.calls.append(("sleep", target, level))
        return self._result("sleep", target, f"sleeping at level {level}")

    async def wake(self, target: int) -> ActionResult:
        self.calls.append(("wake", target))
        return self._result("wake", target, "awake")

    async def clear_kv(self, target: int) -> ActionResult:
        self.calls.append(("clear_kv", target))
        return self._result("clear-kv", target, "cleared 12 cached blocks")

    async def load_lora(self, target: int, name: str, source: str) -> ActionResult:
        self.calls.append(("load_lora", target, name, source))
        return self._result("lora load", target, f"loaded {name}")

    async def unload_lora(self, target: int, name: str) -> ActionResult:
        self.calls.append(("unload_lora", target, name))
        return self._result("lora unload", target, f"unloaded {name}")

    async def close(self) -> None:
        return None
