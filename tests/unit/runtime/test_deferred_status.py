"""An operator's status change during a discovery outage is not lost: written when it answers."""

from __future__ import annotations

import pytest

from dynamod.shared.errors import DiscoveryError
from tests.unit.runtime.support import until
from tests.unit.test_runtime_repairs import FlakyStore, _served, _stored


async def test_deferred_status_is_written_when_discovery_answers_again() -> None:
    store = FlakyStore()
    rt, served = await _served(store)
    try:
        store.fail_prefix, store.failures_left = served.key, 3  # the first write and two retries fail
        assert await served.set_status_eventually("draining", wait_s=0.1) is False
        assert served.write_pending and served.record.status == "ready"  # adopted once written
        await until(lambda: not served.write_pending, timeout=10)
        assert (await _stored(store, served)).status == "draining"
        assert served.record.status == "draining" and store.failures_left == 0
        assert await served.set_status_eventually("ready") is True  # written at once when it can be
        assert (await _stored(store, served)).status == "ready"
    finally:
        await rt.shutdown(0)


async def test_a_newer_status_supersedes_a_deferred_one() -> None:
    store = FlakyStore()
    rt, served = await _served(store)
    try:
        store.fail_prefix, store.failures_left = served.key, 1
        assert await served.set_status_eventually("draining", wait_s=0.1) is False
        await served.set_status("sleeping")  # discovery is back; the operator moved on
        await until(lambda: not served.write_pending, timeout=10)
        assert (await _stored(store, served)).status == "sleeping"
    finally:
        await rt.shutdown(0)


async def test_strict_set_status_still_raises_and_shutdown_stops_the_retries() -> None:
    store = FlakyStore()
    rt, served = await _served(store)
    store.fail_prefix, store.failures_left = served.key, 10**6
    with pytest.raises(DiscoveryError):
        await served.set_status("draining")
    assert not served.write_pending
    assert await served.set_status_eventually("draining", wait_s=0.1) is False
    store.failures_left = 0
    await rt.shutdown(0)  # cancels the retry loop, then deregisters
    assert not served.write_pending and await _stored(store, served) is None
