"""Tokenizer files larger than etcd takes in one request still travel with the model card: the
copy is chunked below etcd's default 1.5 MiB request limit (a real etcd with its defaults)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from dynamod.shared.discovery.etcd import EtcdStore
from dynamod.shared.errors import DiscoveryError
from dynamod.shared.protocol.keys import mdc_files_chunks_prefix
from dynamod.shared.runtime.model_files import CHUNK_BYTES, ModelFiles, ModelFilesPublisher, ModelFilesReader
from tests.fixtures.servers import EtcdServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[EtcdStore]:
    s = EtcdStore([etcd_server.endpoint])
    await s.start()
    yield s
    await s.close()


async def test_a_tokenizer_over_the_etcd_request_limit_round_trips(store: EtcdStore) -> None:
    # Random bytes do not compress: 3 MiB stays 3 MiB, twice what etcd accepts in one put.
    files = ModelFiles.from_files({"tokenizer.json": os.urandom(3 << 20), "tokenizer_config.json": b"{}"})
    assert len(files.compressed) > 3 << 20
    with pytest.raises(DiscoveryError):
        await store.put("v1/test/one-big-value", files.compressed)
    lease = await store.create_lease(10.0)
    publisher = ModelFilesPublisher(store, lease, "big", files)
    await publisher.start()
    try:
        chunks = await store.get_prefix(mdc_files_chunks_prefix("big", files.sha256, lease.id))
        assert len(chunks) == -(-len(files.compressed) // CHUNK_BYTES) >= 4
        fetched = await ModelFilesReader(store, "big", timeout_s=10).fetch(files.ref)
        assert fetched.files == files.files
    finally:
        await publisher.close()
