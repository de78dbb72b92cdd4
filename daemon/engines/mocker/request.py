"""One request's state inside a mocker core: tokens, progress, blocks, hashes and its sampler.

The scheduler, the KV manager and the core all read and write these fields directly (as vLLM's
``Request``), because the step loop touches every running request every step and attribute
access is the cheapest thing Python offers. Output token ids come from a per-request 64-bit LCG
seeded by the request, so the same seed and prompt always give the same tokens; a request with
options the LCG cannot honour carries a ``TokenSampler`` (sampling.py) instead.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from dynamod.shared.kv.hashing import (
    block_mm_key,
    chain_hash,
    compute_block_hashes,
    hash_tokens,
    mm_local_hash,
)
from dynamod.shared.protocol.kv_transfer import KvTransferParams

if TYPE_CHECKING:
    import numpy as np

    from dynamod.daemon.engines.mocker.sampling import TokenSampler
    from dynamod.shared.protocol.llm import MultimodalItem, PrefixPin

_MASK64 = (1 << 64) - 1
_LCG_MUL = 6364136223846793005  # Knuth's MMIX constants
_LCG_INC = 1442695040888963407
_SEED_TAIL_TOKENS = 64


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    WAITING_FOR_REMOTE_KVS = 4  # blocks allocated, the prompt's KV still being read from a prefill worker
    WAITING_FOR_DISK_KVS = 5  # no blocks yet, its prefix's block files still being read from the disk tier


def request_seed(request_id: str, prompt_token_ids: list[int], seed: int | None) -> int:
    """The sampler's starting state: the user's seed (or the request id) mixed with the prompt's
    length and last tokens (O(1) however long the prompt, yet different prompts diverge)."""
    base = xxhash.xxh3_64_intdigest(request_id.encode("utf-8")) if seed is None else seed & _MASK64
    tail = array("I", prompt_token_ids[-_SEED_TAIL_TOKENS:])
    tail.append(len(prompt_token_ids) & 0xFFFFFFFF)
    return xxhash.xxh3_64_intdigest(tail.tobytes(), seed=base)


@dataclass(slots=True)
class RemoteKv:
    """Where a decode request's prompt KV comes from: the prefill worker's transfer parameters.
    ``local_hit_blocks`` is set at admission: the leading blocks this worker already caches, which
    are not read."""

    params: KvTransferParams
    local_hit_blocks: int = 0


class MockRequest:
    """A sequence being served. ``token_ids`` is the prompt followed by the outputs so far."""

    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "max_output_tokens", "min_tokens", "stop_ids",
        "lora_name", "kv_transferred", "status", "num_computed_tokens", "prefill_target",
        "num_cached_tokens", "blocks", "num_cached_blocks", "block_hashes", "local_hashes",
        "num_preemptions", "rng_state", "vocab_size", "finish_reason", "remote", "hold_kv", "sampler",
        "staged_kv", "priority", "arrival", "pin", "num_pinned_tokens", "pin_refused", "mm_items",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_output_tokens: int,
        vocab_size: int,
        min_tokens: int = 0,
        stop_ids: frozenset[int] = frozenset(),
        lora_name: str | None = None,
        seed: int | None = None,
        kv_transferred: bool = False,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_output_tokens = max_output_tokens
        self.min_tokens = min_tokens
        self.stop_ids = stop_ids
        self.lora_name = lora_name
        # Disaggregated decode: the prompt's KV arrives from a prefill worker, so its prefill
        # costs no compute here (it still needs blocks).
        self.kv_transferred = kv_transferred
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens that must be (re)computed before decoding: the prompt, or after a preemption
        # the prompt plus the outputs generated so far.
        self.prefill_target = self.num_prompt_tokens
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.blocks: list = []  # KVBlock list, owned by the KV manager
        self.num_cached_blocks = 0  # how many of ``blocks`` have been offered to the prefix cache
        self.block_hashes: list[int] = []  # sequence hashes of the full blocks hashed so far
        self.local_hashes: list[int] = []
        self.num_preemptions = 0
        self.rng_state = request_seed(request_id, self.token_ids, seed)
        self.vocab_size = vocab_size
        self.finish_reason: str | None = None
        # Disaggregation. ``remote``: where the prompt's KV is to be read from (a decode worker's
        # request, until the read ended); ``hold_kv``: keep the blocks after finishing, for a
        # decode worker to read (a prefill worker's request).
        self.remote: RemoteKv | None = None
        self.hold_kv = False
        # Set for a request whose sampling options the LCG cannot honour (log-probabilities, an
        # output constraint, logit bias, penalties): it samples instead of ``next_token``.
        self.sampler: TokenSampler | None = None
        # Block hash -> bytes read from the disk tier for this request's next admission; None
        # until it has waited for such reads (it waits at most once per admission).
        self.staged_kv: dict[int, np.ndarray] | None = None
        # Scheduling order under the priority policy, in vLLM's convention: lower ``priority``
        # first, then earlier ``arrival`` (numbered by the scheduler as requests are added).
        self.priority = priority
        self.arrival = 0
        # ``cache_control``: the prompt prefix to pin once its blocks are cached (the KV manager
        # applies it once and clears it), the tokens it newly pinned beyond the prefix-cache hit
        # (cache_creation_input_tokens) and whether the pinned-share bound refused it.
        self.pin: PrefixPin | None = None
        self.num_pinned_tokens = 0
        self.pin_refused = False
        # The prompt's images: the blocks covering their placeholder tokens are keyed by their
        # content hashes (shared/kv/hashing.py), as the router hashes the prompt.
        self.mm_items: list[MultimodalItem] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    def hash_prompt(self, block_size: int) -> None:
        """Hashes the prompt's full blocks once, at admission, in C (shared/kv/hashing.py)."""
        self.local_hashes, self.block_hashes = hash_tokens(self.token_ids, block_size, self.lora_name, self.mm_items)

    def ensure_block_hashes(self, num_blocks: int, block_size: int) -> None:
        """Extends the hashes over generated tokens up to ``num_blocks`` full blocks."""
        hashes = self.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            local = compute_block_hashes(self.token_ids[i * block_size : (i + 1) * block_size], block_size, self.lora_name)[0]
            if self.mm_items:  # an image may end in the prompt's partial last block
                local = mm_local_hash(local, block_mm_key(i, block_size, self.mm_items))
            self.local_hashes.append(local)
            hashes.append(local if i == 0 else chain_hash(hashes[i - 1], local))

    def next_token(self) -> int:
        """Samples the next output token; stop tokens are masked out until ``min_tokens``."""
        state = (self.rng_state * _LCG_MUL + _LCG_INC) & _MASK64
        token = (state >> 33) % self.vocab_size
        if self.stop_ids and token in self.stop_ids and self.num_output_tokens < self.min_tokens:
            # vLLM masks stop tokens below min_tokens; step to the next id that is not one.
            while token in self.stop_ids:
                token = (token + 1) % self.vocab_size
        self.rng_state = state
        return token

    def append_plain_tokens(self, n: int) -> None:
        """Appends ``n`` tokens exactly as ``n`` ``next_token()`` calls would, for a request with
        no stop tokens (a replay's stretch of plain decode steps): one loop, not a call per token."""
        if self.stop_ids:
            raise ValueError("append_plain_tokens is for requests without stop tokens")
        state = self.rng_state
        vocab = self.vocab_size
        append = self.token_ids.append
        for _ in range(n):
            state = (state * _LCG_MUL + _LCG_INC) & _MASK64
            append((state >> 33) % vocab)
        self.rng_state = state

    def __repr__(self) -> str:
        return (
            f"MockRequest({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.blocks)})"
        )
