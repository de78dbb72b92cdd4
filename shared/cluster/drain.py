"""Drain a worker before stopping it: the first half of every scale-down.

``drain`` (the worker control endpoint, ``wait: true``) sets the worker's status to ``draining``,
so routers send it nothing new, and answers once its in-flight requests have finished (or the
timeout passed). Stopping it after that loses no request; the worker's SIGTERM path (deregister,
wait for in-flight work) is the net under it when a drain cannot be made. The ``dynamod up``
scaler and the planner's SSH connector both remove workers this way.
"""

from __future__ import annotations

import logging

from dynamod.shared.errors import DynamoError
from dynamod.shared.protocol import control
from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

APPEAR_TIMEOUT_S = 5.0  # the control endpoint's watch may lag the listing the ids came from


async def drain_instances(
    runtime: DistributedRuntime, namespace: str, component: str, instance_ids: list[int], timeout_s: float
) -> bool:
    """Drains each instance in turn; True when all of them report ``drained``. Never raises for
    the cluster's failures (they are logged and make the answer False)."""
    if not instance_ids:
        return False
    client = await runtime.namespace(namespace).component(component).endpoint(control.DRAIN).client()
    request = control.DrainRequest(wait=True, timeout_s=timeout_s)
    ok = True
    try:
        for iid in instance_ids:
            try:
                await client.instance_set.wait_for(lambda insts, i=iid: any(x.instance_id == i for x in insts), APPEAR_TIMEOUT_S)
                replies = await client.call(control.encode_body(request), instance_id=iid, timeout_s=request.reply_timeout_s())
            except (DynamoError, TimeoutError) as exc:
                logger.warning("drain failed component=%s instance=%016x error=%s", component, iid, exc or type(exc).__name__)
                ok = False
                continue
            reply = replies[-1] if replies else {}
            if not isinstance(reply, dict) or reply.get("status") != control.STATUS_OK:
                logger.warning("drain incomplete component=%s instance=%016x reply=%s", component, iid, reply)
                ok = False
            else:
                logger.info("drained component=%s instance=%016x", component, iid)
    finally:
        await client.close()
    return ok
