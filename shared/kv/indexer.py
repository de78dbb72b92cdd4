"""The router's KV index: which worker (and data-parallel rank) caches which prompt prefixes.

``KvIndexer`` is the compiled index (index_native.py, C core in shared/kv/_native/) when it was
built, else the pure-Python one (index_python.py); ``DYN_KV_INDEX_IMPL=python`` forces the latter
(shared/kv/native.py). Both have the behaviour below, checked against one brute-force model in
tests/unit/router/test_indexer_model.py.

A radix tree over prompt prefixes, in blocks. A node *is* a prefix, identified by the chained
sequence hash of its blocks' local hashes (``tokens_hash``; shared/kv/hashing.py), the same chain
the router computes for every request. Engines name their blocks by their own hashes
(``block_hash``), which the router cannot compute, so each worker key ``(worker_id, dp_rank)``
keeps a map engine hash -> node; a later ``KvRemoved`` finds its node through it.

Semantics:

- A worker key *holds* a set of blocks; a block is a path from the root. The held set is always
  prefix-closed: ``KvStored`` extends a held parent (or starts at the root when ``parent_hash`` is
  None) and is dropped, counted as ``parent_missing``, when the parent is not held. Removing a
  block also removes the worker's held descendants: without the prefix they can never match a
  prompt, and keeping them would make the tree size overstate what can be reused.
- An engine hash names one held block from its store until that block is removed (directly, with
  an ancestor, or by a clear). Removing an unknown hash is a no-op. A block may have several names
  (engines whose hashes cover more than the tokens); removing any of them removes the block.
  Storing a known hash at another path first removes the block it named (a hash collision; never
  seen with content-addressed engines).
- ``find_matches`` gives, per worker key, the number of *leading* blocks of the prompt it holds.
- Hashes are u64 (the wire contract); the compiled index takes any other int modulo 2**64.
"""

from __future__ import annotations

from dynamod.shared.kv import native
from dynamod.shared.kv.index_common import APPLIED, PARENT_MISSING, KvIndexerBase, OverlapScores, WorkerKey
from dynamod.shared.kv.index_native import NativeKvIndexer
from dynamod.shared.kv.index_python import PythonKvIndexer

__all__ = [
    "APPLIED",
    "PARENT_MISSING",
    "KvIndexer",
    "KvIndexerBase",
    "NativeKvIndexer",
    "OverlapScores",
    "PythonKvIndexer",
    "WorkerKey",
    "kv_index_implementation",
]

KvIndexer = NativeKvIndexer if native.core is not None else PythonKvIndexer
"""The index class in use (see the module docstring)."""


def kv_index_implementation() -> str:
    """``native`` or ``python``: which index ``KvIndexer`` builds (for logs and benchmarks)."""
    return KvIndexer.implementation
