"""A model's tokenizer files, carried through discovery so a frontend never reads a worker's disk.

Why discovery and not the NATS object store: discovery is there in every setup (etcd across hosts,
the file backend of ``dynamod up``, the in-process ``mem`` store), while NATS is not (``--event-plane
zmq`` with etcd runs without it, and the object store needs JetStream). Discovery also gives the
lifetime for free: every copy lives under its holder's lease, so nothing is left behind when the
workers go, as with every other record of a process. etcd refuses a request over 1.5 MiB by default
and a tokenizer.json of a large vocabulary is several MB (about a quarter of that compressed), so a
copy is cut into chunks of ``CHUNK_BYTES``.

Workers (``ModelFilesPublisher``): the bundle is named by its content hash, so workers of the same
model share it. Only ``copies`` of them (default 2) hold a copy, so etcd holds a few MB per model
however many workers serve it: a worker publishes its copy when it sees fewer holders, and when
more hold one (workers that started together), those beyond the ``copies`` lowest instance ids
withdraw theirs. When a holder dies its lease takes its copy along and a worker without one
publishes in its place (after a short random delay, so they do not all write at once).

Frontends (``ModelFilesReader``): follow the bundle's holders and read one holder's chunks; a copy
that is incomplete (being withdrawn) or whose bytes do not hash to the card's ``sha256`` is skipped
for the next one. The result is verified, so a frontend loads exactly the files the card names.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import random
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from dynamod.shared.discovery.store import DiscoveryStore, Lease
from dynamod.shared.errors import ConfigError, DynamoError, UnavailableError
from dynamod.shared.protocol.keys import (
    mdc_files_chunk_key,
    mdc_files_chunks_prefix,
    mdc_files_copies_prefix,
    mdc_files_copy_key,
)
from dynamod.shared.protocol.model_files import (
    BUNDLE_FORMAT,
    CODEC_ZLIB,
    ModelFilesCopy,
    ModelFilesRef,
    decode_copy,
    encode_copy,
)
from dynamod.shared.runtime.watched_map import WatchedMap

logger = logging.getLogger(__name__)

BUNDLE_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",  # end-of-sequence ids
    "config.json",  # context length, vocabulary size
    "preprocessor_config.json",  # a vision-language model's image processor (image tokens per image)
)
"""What a frontend needs of a model directory (HF layout) to tokenize and apply the chat template;
never the weights."""

REQUIRED_FILE = "tokenizer.json"
CHUNK_BYTES = 1 << 20  # below etcd's default --max-request-bytes (1.5 MiB) with room for the key
MAX_BUNDLE_BYTES = 256 << 20  # a reader refuses to inflate more (a corrupt or hostile copy)
MAX_FILE_BYTES = 64 << 20  # a worker refuses to publish a larger single file (not a tokenizer file)
DEFAULT_COPIES = 2
DEFAULT_FETCH_TIMEOUT_S = 30.0
REPUBLISH_JITTER_S = 0.5
RECHECK_S = 5.0  # holders re-listed this often even without a watch event (a missed change heals)

_bundle_decoder = msgspec.msgpack.Decoder(dict[str, bytes])


@dataclass(frozen=True)
class ModelFiles:
    """The files of a bundle by name, and the hash of the bundle they make."""

    files: Mapping[str, bytes]
    sha256: str

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> ModelFiles:
        ordered = {name: bytes(files[name]) for name in sorted(files)}
        return cls(ordered, hashlib.sha256(_encode_bundle(ordered)).hexdigest())

    @classmethod
    def from_dir(cls, directory: str | Path) -> ModelFiles:
        """Blocking: reads the bundle's files that ``directory`` has (``tokenizer.json`` must be one)."""
        root = Path(directory)
        files: dict[str, bytes] = {}
        for name in BUNDLE_FILE_NAMES:
            path = root / name
            if not path.is_file():
                continue
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                raise ConfigError(f"{path} is {size} bytes, over the {MAX_FILE_BYTES >> 20} MiB a model card may carry")
            files[name] = path.read_bytes()
        if REQUIRED_FILE not in files:
            raise ConfigError(f"{root} has no {REQUIRED_FILE}: a model card must carry the model's tokenizer")
        return cls.from_files(files)

    @classmethod
    def from_compressed(cls, blob: bytes, sha256: str) -> ModelFiles:
        """Inflates and checks a copy; ``ValueError`` saying what is wrong with it."""
        inflater = zlib.decompressobj()
        try:
            bundle = inflater.decompress(blob, MAX_BUNDLE_BYTES + 1)
        except zlib.error as exc:
            raise ValueError(f"not a zlib stream: {exc}") from None
        if len(bundle) > MAX_BUNDLE_BYTES or inflater.unconsumed_tail:
            raise ValueError(f"inflates to more than {MAX_BUNDLE_BYTES >> 20} MiB")
        if not inflater.eof:
            raise ValueError("truncated zlib stream")
        actual = hashlib.sha256(bundle).hexdigest()
        if actual != sha256:
            raise ValueError(f"content hash {actual[:16]} is not the card's {sha256[:16]}")
        try:
            files = _bundle_decoder.decode(bundle)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"not a files bundle: {exc}") from None
        return cls(files, sha256)

    @property
    def size(self) -> int:
        return len(self.bundle)

    @functools.cached_property
    def bundle(self) -> bytes:
        return _encode_bundle(self.files)

    @functools.cached_property
    def compressed(self) -> bytes:
        return zlib.compress(self.bundle, 6)

    @property
    def ref(self) -> ModelFilesRef:
        return ModelFilesRef(sha256=self.sha256, size=self.size, names=list(self.files))

    def write_to(self, directory: str | Path) -> Path:
        """Writes the files into ``directory`` (created), as a model directory's layout has them."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            if name not in BUNDLE_FILE_NAMES:  # a bundle names only these; never a path
                raise ValueError(f"unexpected file name {name!r} in a model files bundle")
            (root / name).write_bytes(data)
        return root


def _encode_bundle(files: Mapping[str, bytes]) -> bytes:
    return msgspec.msgpack.encode(dict(files))


def _chunks(blob: bytes) -> list[bytes]:
    return [blob[i : i + CHUNK_BYTES] for i in range(0, len(blob), CHUNK_BYTES)] or [b""]


class ModelFilesPublisher:
    """Keeps ``copies`` copies of a bundle in discovery, this worker's among them when needed."""

    def __init__(
        self,
        store: DiscoveryStore,
        lease: Lease,
        namespace: str,
        files: ModelFiles,
        *,
        copies: int = DEFAULT_COPIES,
        node: str = "",
        jitter_s: float = REPUBLISH_JITTER_S,
        recheck_s: float = RECHECK_S,
    ) -> None:
        if copies < 1:
            raise ValueError(f"copies must be at least 1, got {copies}")
        self._store = store
        self._lease = lease
        self._namespace = namespace
        self.files = files
        self._copies = copies
        self._node = node
        self._jitter_s = jitter_s
        self._prefix = mdc_files_copies_prefix(namespace, files.sha256)
        self._copy_key = mdc_files_copy_key(namespace, files.sha256, lease.id)
        self._recheck_s = recheck_s
        self._holders: set[int] = set()
        self.holding = False
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        # Any change among the holders wakes the balancer, which re-reads them itself.
        self._holder_records: WatchedMap[int] = WatchedMap(
            store, self._prefix, lambda key, _raw: self._holder_of(key), what="model files holder"
        )
        self._holder_records.add_listener(lambda _key, _holder: self._changed.set())
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def ref(self) -> ModelFilesRef:
        return self.files.ref

    async def start(self) -> None:
        """Publishes this worker's copy if fewer than ``copies`` exist, then follows the holders.
        On return a copy exists (ours or another live worker's), so a card may name the bundle."""
        self._holders = self._parse_holders(await self._store.get_prefix(self._prefix))
        await self._balance(jitter=False)
        await self._holder_records.start()
        name = f"model-files:{self.files.sha256[:12]}"
        self._tasks = [asyncio.create_task(self._keep_balanced(), name=f"{name}:balance")]

    async def close(self) -> None:
        """Stops following and withdraws this worker's copy (the lease would take it anyway)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(self._holder_records.close(), *self._tasks, return_exceptions=True)
        self._tasks = []
        if self.holding:
            with contextlib.suppress(DynamoError):
                await self._withdraw()

    def _holder_of(self, key: str) -> int:
        return int(key[len(self._prefix) :], 16)

    def _parse_holders(self, records: Mapping[str, bytes]) -> set[int]:
        holders = set()
        for key in records:
            try:
                holders.add(self._holder_of(key))
            except ValueError:
                continue
        return holders

    async def _keep_balanced(self) -> None:
        """On every change, and every ``recheck_s`` regardless: list the holders and balance."""
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow the cancel that close() sends.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._recheck_s):
                    await self._changed.wait()
            self._changed.clear()
            try:
                holders = self._parse_holders(await self._store.get_prefix(self._prefix))
                self._holders = holders
                if self.holding and self._lease.id not in holders:  # our copy was wiped: not holding
                    self.holding = False
                await self._balance(jitter=True)
            except DynamoError as exc:
                logger.warning("model files balance failed sha=%s error=%s", self.files.sha256[:12], exc)

    async def _balance(self, *, jitter: bool) -> None:
        async with self._lock:
            me = self._lease.id
            if self.holding and len(self._holders) > self._copies and me not in sorted(self._holders)[: self._copies]:
                await self._withdraw()
                return
            if self.holding or len(self._holders - {me}) >= self._copies:
                return
            if jitter and self._jitter_s > 0:
                # Every worker without a copy saw the same holder go: most find it replaced.
                await asyncio.sleep(random.uniform(0, self._jitter_s))
                self._holders = self._parse_holders(await self._store.get_prefix(self._prefix))
                if len(self._holders - {me}) >= self._copies:
                    return
            await self._publish()

    async def _publish(self) -> None:
        files = self.files
        blob = await asyncio.to_thread(lambda: files.compressed)
        chunks = _chunks(blob)
        ns, sha, me = self._namespace, files.sha256, self._lease.id
        for index, chunk in enumerate(chunks):
            await self._store.put(mdc_files_chunk_key(ns, sha, me, index), chunk, self._lease)
        record = ModelFilesCopy(
            sha256=sha, size=files.size, compressed_size=len(blob), chunks=len(chunks), node=self._node,
            codec=CODEC_ZLIB, format=BUNDLE_FORMAT,
        )
        # The record last: its presence promises every chunk is there.
        await self._store.put(self._copy_key, encode_copy(record), self._lease)
        self.holding = True
        self._holders.add(me)
        logger.info(
            "model files published sha=%s files=%s bytes=%d compressed=%d chunks=%d",
            sha[:12], ",".join(files.files), files.size, len(blob), len(chunks),
        )

    async def _withdraw(self) -> None:
        ns, sha, me = self._namespace, self.files.sha256, self._lease.id
        self.holding = False
        self._holders.discard(me)
        await self._store.delete(self._copy_key)  # first: readers stop choosing this copy
        for key in await self._store.get_prefix(mdc_files_chunks_prefix(ns, sha, me)):
            await self._store.delete(key)
        logger.info("model files copy withdrawn sha=%s holders=%d", sha[:12], len(self._holders))


class ModelFilesReader:
    """Fetches bundles named by model cards, verified against the card's hash."""

    def __init__(self, store: DiscoveryStore, namespace: str, *, timeout_s: float = DEFAULT_FETCH_TIMEOUT_S) -> None:
        self._store = store
        self._namespace = namespace
        self.timeout_s = timeout_s

    async def fetch(self, ref: ModelFilesRef, *, model: str = "") -> ModelFiles:
        """The bundle ``ref`` names, from the first holder whose copy is whole and hashes right.
        Waits for a holder up to ``timeout_s``; then ``UnavailableError``."""
        prefix = mdc_files_copies_prefix(self._namespace, ref.sha256)
        tried: list[str] = []
        found: asyncio.Future[ModelFiles] = asyncio.get_running_loop().create_future()

        def decode(key: str, raw: bytes) -> tuple[int, ModelFilesCopy]:
            return int(key[len(prefix) :], 16), decode_copy(raw)

        async def consider(key: str, copy: tuple[int, ModelFilesCopy] | None) -> None:
            if copy is not None and not found.done():
                files = await self._try_copy(ref, key[len(prefix) :], *copy, tried)
                if files is not None and not found.done():
                    found.set_result(files)

        copies: WatchedMap[tuple[int, ModelFilesCopy]] = WatchedMap(
            self._store, prefix, decode, what="model files copy",
            on_invalid=lambda key, exc: tried.append(f"{key[len(prefix) :]}: bad record ({exc})"),
        )
        copies.add_listener(consider)  # every copy listed or put meanwhile, until one is good
        try:
            async with asyncio.timeout(self.timeout_s):
                await copies.start()
                return await found
        except TimeoutError:
            pass
        except DynamoError as exc:
            tried.append(f"discovery: {exc}")
        finally:
            await copies.close()
        detail = f"; copies tried: {'; '.join(tried)}" if tried else "; no live worker holds a copy"
        raise UnavailableError(
            f"the tokenizer files of model {model!r} (sha256 {ref.sha256[:16]}) are not in discovery "
            f"after {self.timeout_s:g}s{detail}"
        )

    async def _try_copy(
        self, ref: ModelFilesRef, holder: str, instance_id: int, record: ModelFilesCopy, tried: list[str]
    ) -> ModelFiles | None:
        if record.sha256 != ref.sha256 or record.codec != CODEC_ZLIB or record.format != BUNDLE_FORMAT:
            tried.append(f"{holder}: unsupported copy (codec {record.codec}, format {record.format})")
            return None
        if record.size > MAX_BUNDLE_BYTES or record.chunks < 1:
            tried.append(f"{holder}: implausible copy ({record.size} bytes in {record.chunks} chunks)")
            return None
        chunks = await self._store.get_prefix(mdc_files_chunks_prefix(self._namespace, ref.sha256, instance_id))
        keys = [mdc_files_chunk_key(self._namespace, ref.sha256, instance_id, i) for i in range(record.chunks)]
        missing = [k for k in keys if k not in chunks]
        if missing:
            tried.append(f"{holder}: {len(missing)} of {record.chunks} chunks missing")
            return None
        blob = b"".join(chunks[k] for k in keys)
        if len(blob) != record.compressed_size:
            tried.append(f"{holder}: {len(blob)} bytes, the record says {record.compressed_size}")
            return None
        try:
            files = await asyncio.to_thread(ModelFiles.from_compressed, blob, ref.sha256)
        except ValueError as exc:
            tried.append(f"{holder}: {exc}")
            logger.warning("model files copy refused sha=%s holder=%s reason=%s", ref.sha256[:12], holder, exc)
            return None
        logger.info("model files fetched sha=%s holder=%s files=%s bytes=%d", ref.sha256[:12], holder, ",".join(files.files), files.size)
        return files
