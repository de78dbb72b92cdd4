"""The native KV-event subscriber's close keeps its caller's cancellation (a repair found in review:
the test fails without it). Its decoding of real engines' batches: test_vllm_native_kv.py,
test_sglang_adapter.py."""

from __future__ import annotations

import asyncio

from dynamod.daemon.engines.common.kv_subscriber import NativeKvSubscriber, SubscriberEndpoint
from tests.fixtures.cancellation import close_check


async def test_native_kv_subscriber_close_keeps_the_callers_cancellation() -> None:
    for expect_cancel in (True, False):
        sub = NativeKvSubscriber(
            [SubscriberEndpoint("tcp://127.0.0.1:*", bind=True)],
            decode=lambda raw: None,  # type: ignore[arg-type,return-value]
            on_batch=lambda rank, batch: None,
            on_gap=lambda rank, missing: None,
        )

        def install(task: asyncio.Task[None], sub: NativeKvSubscriber = sub) -> None:
            sub._task = task

        await close_check(expect_cancel)(install, sub.close)
        assert sub._sub is None  # the sockets were closed either way
