"""Model cards carry their tokenizer files through discovery: the bundle, its copies, the reader.

Run on the in-process and the file discovery backends (``conftest.store``); the etcd request limit
is exercised against a real etcd in ``tests/integration/discovery/test_model_files_etcd.py``.
"""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import pytest

from dynamod.daemon.frontend.preprocess.model_preprocessor import PreprocessorCache
from dynamod.daemon.models.local import TINY_MODEL_DIR
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.errors import ConfigError, UnavailableError
from dynamod.shared.protocol.keys import (
    mdc_files_chunk_key,
    mdc_files_chunks_prefix,
    mdc_files_copies_prefix,
    mdc_files_copy_key,
)
from dynamod.shared.protocol.model_card import ModelCard, decode_card, encode_card
from dynamod.shared.protocol.model_files import ModelFilesCopy, encode_copy
from dynamod.shared.runtime import model_files as mf
from dynamod.shared.runtime.model_files import ModelFiles, ModelFilesPublisher, ModelFilesReader

pytestmark = pytest.mark.timeout(60)

NS = "test"


async def _wait_for(check, timeout_s: float = 10.0, what: str = "condition"):  # noqa: ANN001, ANN202
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _holders(store: DiscoveryStore, files: ModelFiles) -> set[int]:
    prefix = mdc_files_copies_prefix(NS, files.sha256)
    return {int(k[len(prefix) :], 16) for k in await store.get_prefix(prefix)}


@pytest.fixture(scope="module")
def tiny_files() -> ModelFiles:
    return ModelFiles.from_dir(TINY_MODEL_DIR)


def test_bundle_has_the_tokenizer_files_and_a_content_hash(tiny_files: ModelFiles, tmp_path: Path) -> None:
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= set(tiny_files.files)
    assert "README.md" not in tiny_files.files  # only what a frontend needs
    assert tiny_files.files["tokenizer.json"] == (TINY_MODEL_DIR / "tokenizer.json").read_bytes()
    # The hash is of the content, not of where it came from.
    copy = tmp_path / "elsewhere"
    tiny_files.write_to(copy)
    assert ModelFiles.from_dir(copy).sha256 == tiny_files.sha256
    (copy / "tokenizer_config.json").write_text("{}")
    assert ModelFiles.from_dir(copy).sha256 != tiny_files.sha256


def test_a_directory_without_tokenizer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        ModelFiles.from_dir(tmp_path)


def test_compressed_copy_is_verified(tiny_files: ModelFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    blob = tiny_files.compressed
    assert len(blob) < tiny_files.size / 2
    assert ModelFiles.from_compressed(blob, tiny_files.sha256).files == tiny_files.files
    with pytest.raises(ValueError, match="content hash"):
        ModelFiles.from_compressed(blob, "0" * 64)
    with pytest.raises(ValueError, match="truncated"):
        ModelFiles.from_compressed(blob[: len(blob) // 2], tiny_files.sha256)
    with pytest.raises(ValueError, match="not a zlib stream"):
        ModelFiles.from_compressed(b"plain bytes", tiny_files.sha256)
    monkeypatch.setattr(mf, "MAX_BUNDLE_BYTES", 1000)
    with pytest.raises(ValueError, match="inflates to more than"):
        ModelFiles.from_compressed(zlib.compress(b"\0" * 5000), tiny_files.sha256)


def test_card_carries_the_reference_and_old_cards_still_decode(tiny_files: ModelFiles) -> None:
    card = ModelCard(served_model_name="tiny", tokenizer_source="/worker/only", model_files=tiny_files.ref)
    back = decode_card(encode_card(card))
    assert back.model_files == tiny_files.ref and back.model_files.names == sorted(tiny_files.files)
    old = decode_card(b'{"served_model_name": "tiny", "tokenizer_source": "/models/tiny"}')
    assert old.model_files is None


async def test_published_in_chunks_and_fetched_verified(
    store: DiscoveryStore, tiny_files: ModelFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mf, "CHUNK_BYTES", 4096)  # several chunks, as a large tokenizer on etcd
    lease = await store.create_lease(5.0)
    publisher = ModelFilesPublisher(store, lease, NS, tiny_files, node="worker-a")
    await publisher.start()
    try:
        assert publisher.holding
        chunks = await store.get_prefix(mdc_files_chunks_prefix(NS, tiny_files.sha256, lease.id))
        assert len(chunks) == -(-len(tiny_files.compressed) // 4096) > 1
        assert all(len(v) <= 4096 for v in chunks.values())
        fetched = await ModelFilesReader(store, NS, timeout_s=5).fetch(tiny_files.ref)
        assert fetched.files == tiny_files.files and fetched.sha256 == tiny_files.sha256
    finally:
        await publisher.close()
    assert await store.get_prefix(mdc_files_copies_prefix(NS, tiny_files.sha256)) == {}
    assert await store.get_prefix(mdc_files_chunks_prefix(NS, tiny_files.sha256, lease.id)) == {}


async def test_copies_are_bounded_and_replaced_when_a_holder_goes(store: DiscoveryStore, tiny_files: ModelFiles) -> None:
    leases = [await store.create_lease(5.0) for _ in range(3)]
    pubs = [ModelFilesPublisher(store, lease, NS, tiny_files, copies=2, jitter_s=0.05) for lease in leases]
    try:
        for p in pubs:
            await p.start()
        assert [p.holding for p in pubs] == [True, True, False]
        assert await _holders(store, tiny_files) == {leases[0].id, leases[1].id}
        # A holder's process ends: its lease takes its copy along, and the spare worker steps in.
        await pubs[0].close()
        await leases[0].revoke()
        await _wait_for(lambda: _holders_are(store, tiny_files, {leases[1].id, leases[2].id}), what="a new holder")
        assert pubs[2].holding
        fetched = await ModelFilesReader(store, NS, timeout_s=5).fetch(tiny_files.ref)
        assert fetched.sha256 == tiny_files.sha256
    finally:
        for p in pubs:
            await p.close()


async def _holders_are(store: DiscoveryStore, files: ModelFiles, expected: set[int]) -> bool:
    return await _holders(store, files) == expected


async def test_workers_starting_together_converge_to_the_bound(store: DiscoveryStore, tiny_files: ModelFiles) -> None:
    leases = [await store.create_lease(5.0) for _ in range(4)]
    pubs = [ModelFilesPublisher(store, lease, NS, tiny_files, copies=2, jitter_s=0.05) for lease in leases]
    try:
        await asyncio.gather(*(p.start() for p in pubs))  # all see no holder and publish
        lowest = set(sorted(lease.id for lease in leases)[:2])
        await _wait_for(lambda: _holders_are(store, tiny_files, lowest), what="the extra copies withdrawn")
        await _wait_for(lambda: _no_orphan_chunks(store, tiny_files, leases, lowest), what="their chunks deleted")
    finally:
        for p in pubs:
            await p.close()


async def _no_orphan_chunks(store: DiscoveryStore, files: ModelFiles, leases: list, holders: set[int]) -> bool:
    for lease in leases:
        chunks = await store.get_prefix(mdc_files_chunks_prefix(NS, files.sha256, lease.id))
        if lease.id not in holders and chunks:
            return False
    return True


async def test_a_wiped_copy_is_published_again(store: DiscoveryStore, tiny_files: ModelFiles) -> None:
    """Someone deletes the keys (an operator's etcdctl del, a cleaned directory): the holder puts
    its copy back, as a lease's keys are put back after an outage."""
    lease = await store.create_lease(5.0)
    publisher = ModelFilesPublisher(store, lease, NS, tiny_files, jitter_s=0.01, recheck_s=0.2)
    await publisher.start()
    try:
        await store.delete(mdc_files_copy_key(NS, tiny_files.sha256, lease.id))
        await _wait_for(lambda: _holders_are(store, tiny_files, {lease.id}), what="the copy published again")
        fetched = await ModelFilesReader(store, NS, timeout_s=5).fetch(tiny_files.ref)
        assert fetched.files == tiny_files.files
    finally:
        await publisher.close()


async def test_no_holder_is_an_unavailable_error_not_a_hang(store: DiscoveryStore, tiny_files: ModelFiles) -> None:
    with pytest.raises(UnavailableError, match="no live worker holds a copy"):
        await ModelFilesReader(store, NS, timeout_s=0.3).fetch(tiny_files.ref, model="tiny")


async def test_a_corrupt_copy_is_skipped_for_a_good_one(store: DiscoveryStore, tiny_files: ModelFiles) -> None:
    bad_lease = await store.create_lease(5.0)
    sha = tiny_files.sha256
    forged = zlib.compress(b"not the files")
    await store.put(mdc_files_chunk_key(NS, sha, bad_lease.id, 0), forged, bad_lease)
    record = ModelFilesCopy(sha256=sha, size=tiny_files.size, compressed_size=len(forged), chunks=1)
    await store.put(mdc_files_copy_key(NS, sha, bad_lease.id), encode_copy(record), bad_lease)
    with pytest.raises(UnavailableError, match="content hash"):
        await ModelFilesReader(store, NS, timeout_s=0.3).fetch(tiny_files.ref)
    # copies=3: the forged record counts as a holder; the real worker still adds its copy.
    good_lease = await store.create_lease(5.0)
    publisher = ModelFilesPublisher(store, good_lease, NS, tiny_files, copies=3)
    await publisher.start()
    try:
        fetched = await ModelFilesReader(store, NS, timeout_s=5).fetch(tiny_files.ref)
        assert fetched.files == tiny_files.files
    finally:
        await publisher.close()


async def test_frontend_loads_the_tokenizer_from_discovery_not_the_path(
    store: DiscoveryStore, tiny_files: ModelFiles
) -> None:
    """The card's tokenizer_source names a directory that does not exist here (the worker's
    disk): the frontend loads the files the card carries, and fails over to nothing else."""
    lease = await store.create_lease(5.0)
    publisher = ModelFilesPublisher(store, lease, NS, tiny_files)
    await publisher.start()
    try:
        card = ModelCard(
            served_model_name="tiny", tokenizer_source="/nonexistent/worker/models/tiny", model_files=tiny_files.ref
        )
        cache = PreprocessorCache(ModelFilesReader(store, NS, timeout_s=5))
        pre = await cache.get(card)
        assert pre.source == f"model_files:{tiny_files.sha256[:16]}"
        assert pre.chat_template is not None  # from tokenizer_config.json in the bundle
        ids = await pre.encode("hello world", add_special_tokens=False)
        reference = await PreprocessorCache().get(ModelCard(served_model_name="t", tokenizer_source=str(TINY_MODEL_DIR)))
        assert ids == await reference.encode("hello world", add_special_tokens=False)
        # A LoRA card (same files) shares the loaded tokenizer.
        lora = ModelCard(served_model_name="a", lora="a", tokenizer_source="/x", model_files=tiny_files.ref)
        assert await cache.get(lora) is pre
    finally:
        await publisher.close()


async def test_a_card_without_files_still_loads_from_its_path(store: DiscoveryStore) -> None:
    """Backward compatible: a card of an older worker carries no files and names a local path."""
    cache = PreprocessorCache(ModelFilesReader(store, NS, timeout_s=0.3))
    pre = await cache.get(ModelCard(served_model_name="tiny", tokenizer_source=str(TINY_MODEL_DIR)))
    assert pre.source == str(TINY_MODEL_DIR)
