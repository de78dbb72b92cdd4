"""A served endpoint's writes during a discovery outage: an operator's status change is not lost
(written when discovery answers), and status, labels and deregistration are adopted only after
the store write, so the operator's retry does them (repairs found in review: each of those two
tests fails without its repair)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynamod.shared.errors import DiscoveryError
from tests.fixtures.discovery_faults import FlakyStore
from tests.unit.runtime.support import served_endpoint, stored_instance, until


@contextlib.asynccontextmanager
async def _failing_writes(failures: int) -> AsyncIterator[tuple[FlakyStore, Any]]:
    """An endpoint served on a ``FlakyStore`` whose next ``failures`` writes of its instance record
    fail; the runtime shuts down on exit."""
    store = FlakyStore()
    rt, served = await served_endpoint(store)
    try:
        store.fail_prefix, store.failures_left = served.key, failures
        yield store, served
    finally:
        await rt.shutdown(0)


async def test_deferred_status_is_written_when_discovery_answers_again() -> None:
    async with _failing_writes(3) as (store, served):  # the first write and two retries fail
        assert await served.set_status_eventually("draining", wait_s=0.1) is False
        assert served.write_pending and served.record.status == "ready"  # adopted once written
        await until(lambda: not served.write_pending, timeout=10)
        assert (await stored_instance(store, served)).status == "draining"
        assert served.record.status == "draining" and store.failures_left == 0
        assert await served.set_status_eventually("ready") is True  # written at once when it can be
        assert (await stored_instance(store, served)).status == "ready"


async def test_a_newer_status_supersedes_a_deferred_one() -> None:
    async with _failing_writes(1) as (store, served):
        assert await served.set_status_eventually("draining", wait_s=0.1) is False
        await served.set_status("sleeping")  # discovery is back; the operator moved on
        await until(lambda: not served.write_pending, timeout=10)
        assert (await stored_instance(store, served)).status == "sleeping"


async def test_strict_set_status_still_raises_and_shutdown_stops_the_retries() -> None:
    store = FlakyStore()
    rt, served = await served_endpoint(store)
    store.fail_prefix, store.failures_left = served.key, 10**6
    with pytest.raises(DiscoveryError):
        await served.set_status("draining")
    assert not served.write_pending
    assert await served.set_status_eventually("draining", wait_s=0.1) is False
    store.failures_left = 0
    await rt.shutdown(0)  # cancels the retry loop, then deregisters
    assert not served.write_pending and await stored_instance(store, served) is None


# -- status adopted only after the store write (repairs found in review) --------------------------


async def test_set_status_and_labels_after_a_failed_write_are_written_by_the_retry() -> None:
    async with _failing_writes(1) as (store, served):
        with pytest.raises(DiscoveryError):
            await served.set_status("draining")
        assert served.record.status == "ready"  # not adopted: discovery still says ready
        await served.set_status("draining")  # the operator's retry
        assert (await stored_instance(store, served)).status == "draining"
        assert served.record.status == "draining"

        store.failures_left = 1
        with pytest.raises(DiscoveryError):
            await served.update_labels(pool="a")
        assert "pool" not in served.record.labels
        await served.update_labels(pool="a")
        assert (await stored_instance(store, served)).labels == {"pool": "a"}


async def test_deregister_after_a_failed_delete_is_done_by_the_retry() -> None:
    async with _failing_writes(1) as (store, served):
        with pytest.raises(DiscoveryError):
            await served.deregister()
        assert served.registered
        await served.deregister()
        assert await stored_instance(store, served) is None and not served.registered
