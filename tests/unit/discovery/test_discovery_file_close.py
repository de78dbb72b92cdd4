"""The file store's lease revoke and close keep their caller's cancellation (a repair found in review:
the test fails without it). The same on a real etcd: tests/integration/runtime/test_runtime_repairs_etcd.py."""

from __future__ import annotations

import asyncio

from dynamod.shared.discovery.file import FileStore
from tests.fixtures.cancellation import close_check


async def test_file_store_lease_revoke_and_close_keep_the_callers_cancellation(tmp_path) -> None:
    for i, (expect_cancel, via_close) in enumerate([(True, False), (True, True), (False, False), (False, True)]):
        store = FileStore(str(tmp_path / f"kv{i}"))
        await store.start()
        lease = await store.create_lease(5)
        assert lease.task is not None
        lease.task.cancel()

        def install(task: asyncio.Task[None], lease=lease) -> None:
            lease.task = task

        await close_check(expect_cancel)(install, store.close if via_close else lease.revoke)
        await store.close()
