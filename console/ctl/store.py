"""A discovery store opened for one dynamoctl command: no runtime, no lease.

Commands that only read or write keys (``planner status``, ``scale``, ``intent``) need neither a
request plane nor an event plane; this opens the store the connection flags name and gives up with
one clear line when it does not answer within ``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from dynamod.console.settings import settings_from_args
from dynamod.shared.errors import DiscoveryError

if TYPE_CHECKING:
    from dynamod.shared.discovery.store import DiscoveryStore


@contextlib.asynccontextmanager
async def command_store(args: argparse.Namespace) -> AsyncIterator[DiscoveryStore]:
    from dynamod.shared.discovery.factory import make_store

    settings = settings_from_args(args)
    store = make_store(
        settings.discovery,
        etcd_endpoints=settings.etcd_endpoints,
        file_root=settings.file_kv,
        etcd_security=settings.security.etcd,
    )
    try:
        await asyncio.wait_for(store.start(), args.timeout)
    except TimeoutError:
        raise DiscoveryError(
            f"no answer from {settings.discovery} discovery ({settings.discovery_target()}) within {args.timeout:g}s"
        ) from None
    try:
        yield store
    finally:
        await store.close()
