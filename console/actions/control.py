"""Calls a worker's control endpoints by instance id: the one code path behind every console key
and every ``dynamoctl`` verb (``ControlClient.run(spec, target, body)``).

The target is found in discovery (any namespace and component), the call goes direct to that
instance over the request plane (so a draining or sleeping worker is reachable), and the reply is
turned into an ``ActionResult`` with a one-line message whether it succeeded or not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from dynamod.console.actions.specs import ActionSpec
from dynamod.shared.errors import DynamoError, NotFoundError, ProtocolError
from dynamod.shared.protocol import control
from dynamod.shared.protocol.instance import Instance, decode_instance
from dynamod.shared.protocol.keys import instances_prefix
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.client import EndpointClient

if TYPE_CHECKING:
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)



@dataclass(slots=True)
class ActionResult:
    action: str
    target: str  # instance id in hex
    ok: bool
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "instance": self.target, "ok": self.ok, "message": self.message, **self.data}


def resolve_instance_id(text: str, known: list[int]) -> int:
    """An instance id from what an operator typed: the full hex id, or a unique hex prefix."""
    needle = text.strip().lower().removeprefix("0x")
    if not needle:
        raise NotFoundError("empty instance id")
    try:
        int(needle, 16)
    except ValueError:
        raise NotFoundError(f"{text!r} is not an instance id (hex, as `dynamoctl status` prints it)") from None
    # Ids print zero-padded to 16 digits (``worker_id_hex``); an unpadded one is the same id.
    exact = [i for i in known if needle in (f"{i:x}", worker_id_hex(i))]
    if exact:
        return exact[0]
    matches = sorted({i for i in known if f"{i:x}".startswith(needle) or worker_id_hex(i).startswith(needle)})
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFoundError(f"no instance {needle} in discovery")
    shown = ", ".join(worker_id_hex(i) for i in matches[:5])
    raise NotFoundError(f"instance id {needle} is ambiguous: matches {shown}")


class ControlClient:
    """Sends control requests through a runtime. Endpoint clients are cached per endpoint."""

    def __init__(self, runtime: DistributedRuntime, *, namespace: str | None = None) -> None:
        self._rt = runtime
        self._namespace = namespace
        self._clients: dict[tuple[str, str, str], EndpointClient] = {}

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    async def instances(self) -> list[Instance]:
        out = []
        for value in (await self._rt.store.get_prefix(instances_prefix(self._namespace))).values():
            try:
                out.append(decode_instance(value))
            except msgspec.DecodeError:
                continue
        return out

    async def resolve(self, target: str | int, endpoint: str) -> Instance:
        """The record of ``endpoint`` served by the instance ``target`` (id or unique prefix)."""
        records = await self.instances()
        iid = target if isinstance(target, int) else resolve_instance_id(target, sorted({r.instance_id for r in records}))
        mine = [r for r in records if r.instance_id == iid]
        if not mine:
            raise NotFoundError(f"no instance {worker_id_hex(iid)} in discovery")
        for r in mine:
            if r.endpoint == endpoint:
                return r
        comps = ", ".join(sorted({f"{r.namespace}/{r.component}" for r in mine}))
        raise NotFoundError(f"instance {worker_id_hex(iid)} ({comps}) does not serve the {endpoint} control endpoint")

    async def _client(self, rec: Instance) -> EndpointClient:
        key = (rec.namespace, rec.component, rec.endpoint)
        client = self._clients.get(key)
        if client is None:
            client = await self._rt.namespace(rec.namespace).component(rec.component).endpoint(rec.endpoint).client()
            self._clients[key] = client
        if client.instance_set.get(rec.instance_id) is None:
            # The watch may lag the listing we resolved from by a moment.
            await client.instance_set.wait_for(lambda insts: any(i.instance_id == rec.instance_id for i in insts), 5.0)
        return client

    async def call_instance(self, rec: Instance, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """Sends ``body`` to the endpoint of ``rec`` on that instance and returns its last reply.
        Raises ``DynamoError`` for a failure on the way or a reply that is not a map, and
        ``TimeoutError`` when the instance does not appear on the request plane in time. ``run``
        builds on it; readers of a control endpoint that is not an action (``traces``) call it."""
        client = await self._client(rec)
        replies = await client.call(body, instance_id=rec.instance_id, timeout_s=timeout_s)
        reply = replies[-1] if replies else {}
        if not isinstance(reply, dict):
            raise ProtocolError(f"unexpected reply {reply!r}")
        return reply

    async def run(self, spec: ActionSpec, target: str | int, body: control.ControlBody) -> ActionResult:
        """Runs action ``spec`` on the instance ``target`` (id or unique hex prefix) with ``body``,
        which must be the spec's body type. Never raises for cluster-side failures: they come back
        as ``ok=False`` with the reason."""
        if not isinstance(body, spec.body):
            raise TypeError(f"{spec.name} takes a {spec.body.__name__}, not a {type(body).__name__}")
        label = target if isinstance(target, str) else worker_id_hex(target)
        try:
            rec = await self.resolve(target, spec.endpoint)
            label = worker_id_hex(rec.instance_id)
            reply = await self.call_instance(rec, control.encode_body(body), timeout_s=body.reply_timeout_s())
        except DynamoError as exc:
            logger.info("control call failed action=%s instance=%s error=%s", spec.verb, label, exc)
            return ActionResult(spec.verb, label, False, str(exc))
        except TimeoutError:
            return ActionResult(spec.verb, label, False, f"instance {label} did not appear on the request plane in time")
        ok = reply.get("status") == control.STATUS_OK
        message = str(reply.get("message", "")) or ("ok" if ok else "failed")
        data = {k: v for k, v in reply.items() if k not in ("status", "message")}
        logger.info("control call action=%s instance=%s ok=%s message=%s", spec.verb, label, ok, message)
        return ActionResult(spec.verb, label, ok, message, data)
