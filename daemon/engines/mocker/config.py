"""Settings of the mocker engine, with Dynamo's flag names and defaults.

One ``MockerConfig`` describes one engine (all of its data-parallel ranks share it). The numbers
that shape scheduling and memory mirror vLLM's engine arguments because the router, the planner and
the trace replayer reason in those terms (blocks, batched tokens, sequences); the three values a
real engine takes from its tokenizer and model (``vocab_size``, ``eos_token_ids``,
``context_length``) are passed in by the daemon, which owns the tokenizer.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from dynamod.daemon.engines.mocker.encoder import DEFAULT_ENCODE_MS_PER_IMAGE_TOKEN
from dynamod.daemon.engines.mocker.pins import DEFAULT_MAX_PINNED_FRACTION
from dynamod.daemon.engines.mocker.request_queue import POLICY_FCFS, SCHEDULING_POLICIES
from dynamod.daemon.perf.mocker_timing import DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_MAX_NUM_BATCHED_TOKENS
from dynamod.shared.errors import ConfigError
from dynamod.shared.security.private_dir import user_runtime_dir

DEFAULT_NUM_GPU_BLOCKS = 16384
DEFAULT_BLOCK_SIZE = 64
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_WATERMARK = 0.01
DEFAULT_SPEEDUP_RATIO = 1.0
DEFAULT_DATA_PARALLEL_SIZE = 1
DEFAULT_VOCAB_SIZE = 32000
# KV tiers. Bytes per token size the blocks the tiers move when the engine keeps no bytes of its
# own (DEFAULT_KV_BYTES_PER_TOKEN, daemon/perf/mocker_timing.py); bandwidths are decimal GB/s
# (PCIe Gen4 x16 for host <-> device, an NVMe Gen4 drive for the disk), 0 meaning unlimited.
DEFAULT_HOST_D2H_GBPS = 25.0
DEFAULT_HOST_H2D_GBPS = 25.0
DEFAULT_DISK_WRITE_GBPS = 3.0
DEFAULT_DISK_READ_GBPS = 6.0
# Per user and private (0700, owner checked: shared/security/private_dir): the files hold prompt content.
DEFAULT_DISK_CACHE_DIR = str(user_runtime_dir() / "kv-disk")
DEFAULT_DISK_IO_QUEUE_BLOCKS = 64  # block files being written or read at once, per rank


class MockerConfigError(ConfigError, ValueError):
    """A mocker setting out of range. Both a ``ConfigError`` (CLI: one line, exit non-zero) and a
    ``ValueError`` (library callers building a config by hand)."""


@dataclass(slots=True)
class MockerConfig:
    """The mocker's engine arguments. ``context_length`` 0 means "as long as the KV cache holds"."""

    num_gpu_blocks: int = DEFAULT_NUM_GPU_BLOCKS
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    watermark: float = DEFAULT_WATERMARK
    scheduling_policy: str = POLICY_FCFS  # vLLM's --scheduling-policy: fcfs or priority
    speedup_ratio: float = DEFAULT_SPEEDUP_RATIO
    data_parallel_size: int = DEFAULT_DATA_PARALLEL_SIZE
    vocab_size: int = DEFAULT_VOCAB_SIZE
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    context_length: int = 0
    # Lower KV tiers behind each rank's device cache (tiers.py); 0 blocks: the tier is off.
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    disk_cache_dir: str = DEFAULT_DISK_CACHE_DIR  # the daemon adds a per-worker, per-rank part
    disk_cache_persist: bool = False
    disk_io_queue_blocks: int = DEFAULT_DISK_IO_QUEUE_BLOCKS
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN  # sizes tier transfers without a KV layout
    host_offload_d2h_bandwidth_gbps: float = DEFAULT_HOST_D2H_GBPS
    host_offload_h2d_bandwidth_gbps: float = DEFAULT_HOST_H2D_GBPS
    disk_offload_write_bandwidth_gbps: float = DEFAULT_DISK_WRITE_GBPS
    disk_offload_read_bandwidth_gbps: float = DEFAULT_DISK_READ_GBPS
    # Pinned prefixes (cache_control) may hold at most this share of each rank's device blocks.
    max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION
    # The vision encoder's simulated cost (encoder.py): ms per image token encoded.
    encode_ms_per_image_token: float = DEFAULT_ENCODE_MS_PER_IMAGE_TOKEN

    def __post_init__(self) -> None:
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        self.validate()
        if self.context_length == 0:
            self.context_length = self.kv_capacity_tokens

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens one data-parallel rank's KV cache can hold."""
        return self.num_gpu_blocks * self.block_size

    @property
    def has_lower_tiers(self) -> bool:
        return self.num_host_blocks > 0 or self.num_disk_blocks > 0

    @property
    def watermark_blocks(self) -> int:
        """Free blocks kept back when admitting new requests (vLLM's ``watermark_blocks``)."""
        return int(self.watermark * self.num_gpu_blocks)

    def validate(self) -> None:
        """Raises ``MockerConfigError`` naming the flag and the accepted range."""
        _positive("--num-gpu-blocks", self.num_gpu_blocks)
        _positive("--block-size", self.block_size)
        _positive("--max-num-seqs", self.max_num_seqs)
        _positive("--max-num-batched-tokens", self.max_num_batched_tokens)
        _positive("--data-parallel-size", self.data_parallel_size)
        _positive("vocab_size", self.vocab_size)
        if not 0.0 <= self.watermark < 1.0:
            raise MockerConfigError(f"--watermark must be in [0, 1), got {self.watermark}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise MockerConfigError(
                f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if not self.speedup_ratio > 0.0:
            raise MockerConfigError(f"--speedup-ratio must be > 0, got {self.speedup_ratio}")
        if self.context_length < 0:
            raise MockerConfigError(f"context_length must be >= 0 (0: KV capacity), got {self.context_length}")
        if self.context_length > self.kv_capacity_tokens:
            raise MockerConfigError(
                f"context_length {self.context_length} exceeds the KV cache capacity of "
                f"{self.kv_capacity_tokens} tokens (--num-gpu-blocks {self.num_gpu_blocks} x "
                f"--block-size {self.block_size}); a request that long could never be scheduled"
            )
        for name, blocks in (("--num-host-blocks", self.num_host_blocks), ("--num-disk-blocks", self.num_disk_blocks)):
            if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0:
                raise MockerConfigError(f"{name} must be an integer >= 0 (0: no such tier), got {blocks!r}")
        if self.has_lower_tiers and not self.enable_prefix_caching:
            raise MockerConfigError("--num-host-blocks/--num-disk-blocks need prefix caching (--enable-prefix-caching)")
        _positive("--kv-bytes-per-token", self.kv_bytes_per_token)
        for name, gbps in (
            ("--host-offload-d2h-bandwidth-gbps", self.host_offload_d2h_bandwidth_gbps),
            ("--host-offload-h2d-bandwidth-gbps", self.host_offload_h2d_bandwidth_gbps),
            ("--disk-offload-write-bandwidth-gbps", self.disk_offload_write_bandwidth_gbps),
            ("--disk-offload-read-bandwidth-gbps", self.disk_offload_read_bandwidth_gbps),
        ):
            if not gbps >= 0.0:
                raise MockerConfigError(f"{name} must be >= 0 (0: unlimited), got {gbps}")
        _positive("--disk-io-queue-blocks", self.disk_io_queue_blocks)
        if not self.encode_ms_per_image_token >= 0.0:
            raise MockerConfigError(f"--encode-ms-per-image-token must be >= 0, got {self.encode_ms_per_image_token}")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise MockerConfigError(f"--max-pinned-fraction must be in [0, 1], got {self.max_pinned_fraction}")
        if self.num_disk_blocks and not self.disk_cache_dir:
            raise MockerConfigError("--disk-cache-dir must not be empty with --num-disk-blocks")
        for tok in self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise MockerConfigError(f"eos token id {tok} is outside the vocabulary [0, {self.vocab_size})")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise MockerConfigError(f"{name} must be a positive integer, got {value!r}")


def add_mocker_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Adds the mocker's flags (Dynamo's names and defaults) to the daemon's parser, in one group."""
    group = parser.add_argument_group("mocker engine")
    add_mocker_flags(group)
    return group


def add_mocker_flags(group: argparse._ActionsContainer) -> None:
    """Adds the mocker's flags to an existing parser or argument group."""
    group.add_argument(
        "--num-gpu-blocks", type=int, default=DEFAULT_NUM_GPU_BLOCKS,
        help="KV cache blocks per data-parallel rank (default: %(default)s)",
    )
    group.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
        help="tokens per KV block (default: %(default)s)",
    )
    group.add_argument(
        "--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
        help="most sequences running at once (default: %(default)s)",
    )
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="token budget of one engine step; longer prompts are prefilled in chunks (default: %(default)s)",
    )
    group.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse cached KV blocks across requests (default: on)",
    )
    group.add_argument(
        "--watermark", type=float, default=DEFAULT_WATERMARK,
        help="fraction of KV blocks kept free when admitting requests (default: %(default)s)",
    )
    group.add_argument(
        "--scheduling-policy", choices=SCHEDULING_POLICIES, default=POLICY_FCFS,
        help="as vLLM's: fcfs admits in arrival order; priority admits by request priority (nvext.agent_hints."
        "priority, higher first), then arrival, and preempts the least urgent request when memory runs out "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--speedup-ratio", type=float, default=DEFAULT_SPEEDUP_RATIO,
        help="simulated step times are divided by this (default: %(default)s)",
    )
    group.add_argument(
        "--data-parallel-size", type=int, default=DEFAULT_DATA_PARALLEL_SIZE,
        help="data-parallel ranks, each with its own scheduler and KV cache (default: %(default)s)",
    )
    add_tier_flags(group)
    group.add_argument(
        "--encode-ms-per-image-token", type=float,
        default=_env("DYN_ENCODE_MS_PER_IMAGE_TOKEN", str(DEFAULT_ENCODE_MS_PER_IMAGE_TOKEN)),
        help="simulated vision-encoder time per image token, spent in the step that first prefills an "
        "image's tokens (a fully cached image is not encoded) [env DYN_ENCODE_MS_PER_IMAGE_TOKEN, "
        "default %(default)s]",
    )
    group.add_argument(
        "--max-pinned-fraction", type=float,
        default=_env("DYN_MAX_PINNED_FRACTION", str(DEFAULT_MAX_PINNED_FRACTION)),
        help="share of each rank's KV blocks that prefixes pinned by cache_control may hold; a pin that "
        "would exceed it is refused (the request runs unpinned); 0 refuses every pin "
        "[env DYN_MAX_PINNED_FRACTION, default %(default)s]",
    )


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def add_tier_flags(group: argparse._ActionsContainer) -> None:
    """The host and disk KV tiers' flags (Dynamo's names where it has them), with DYN_* fallbacks."""
    group.add_argument(
        "--num-host-blocks", type=int, default=_env("DYN_NUM_HOST_BLOCKS", "0"),  # argparse converts a string default
        help="host (CPU) KV tier per data-parallel rank, in blocks: device evictions go there and a "
        "prefix found there is onboarded instead of recomputed; 0 disables it "
        "[env DYN_NUM_HOST_BLOCKS, default %(default)s]",
    )
    group.add_argument(
        "--num-disk-blocks", type=int, default=_env("DYN_NUM_DISK_BLOCKS", "0"),
        help="disk KV tier per data-parallel rank, in blocks, behind the host tier (one file per block "
        "under --disk-cache-dir); 0 disables it [env DYN_NUM_DISK_BLOCKS, default %(default)s]",
    )
    group.add_argument(
        "--disk-cache-dir", default=_env("DYN_DISK_CACHE_DIR", DEFAULT_DISK_CACHE_DIR),
        help="directory of the disk KV tier (a subdirectory per worker and rank); created 0700 and refused when "
        "another user owns it [env DYN_DISK_CACHE_DIR, default %(default)s]",
    )
    group.add_argument(
        "--disk-cache-persist", action=argparse.BooleanOptionalAction,
        default=_env("DYN_DISK_CACHE_PERSIST", "0").lower() in ("1", "true", "yes", "on"),
        help="keep the disk tier's files when the worker stops and re-use them at the next start; "
        "otherwise they are removed [env DYN_DISK_CACHE_PERSIST, default off]",
    )
    group.add_argument(
        "--disk-io-queue-blocks", type=int, default=_env("DYN_DISK_IO_QUEUE_BLOCKS", str(DEFAULT_DISK_IO_QUEUE_BLOCKS)),
        help="block files the disk tier writes or reads in the background at once, per rank; when "
        "full, an offload skips the disk and an onboard recomputes instead of waiting "
        "[env DYN_DISK_IO_QUEUE_BLOCKS, default %(default)s]",
    )
    for flag, env, default, what in (
        ("--host-offload-d2h-bandwidth-gbps", "DYN_HOST_OFFLOAD_D2H_BANDWIDTH_GBPS", DEFAULT_HOST_D2H_GBPS,
         "device to host (offload)"),
        ("--host-offload-h2d-bandwidth-gbps", "DYN_HOST_OFFLOAD_H2D_BANDWIDTH_GBPS", DEFAULT_HOST_H2D_GBPS,
         "host to device (onboard)"),
        ("--disk-offload-write-bandwidth-gbps", "DYN_DISK_OFFLOAD_WRITE_BANDWIDTH_GBPS", DEFAULT_DISK_WRITE_GBPS,
         "host to disk (offload)"),
        ("--disk-offload-read-bandwidth-gbps", "DYN_DISK_OFFLOAD_READ_BANDWIDTH_GBPS", DEFAULT_DISK_READ_GBPS,
         "disk to host (onboard, then host to device)"),
    ):
        group.add_argument(
            flag, type=float, default=_env(env, str(default)),
            help=f"KV tier bandwidth {what}, decimal GB/s per rank; 0 is unlimited [env {env}, default %(default)s]",
        )


def config_from_args(
    ns: argparse.Namespace,
    *,
    vocab_size: int | None = None,
    eos_token_ids: tuple[int, ...] | list[int] | None = None,
    context_length: int | None = None,
) -> MockerConfig:
    """Builds the config from parsed flags; the tokenizer-derived values come from the daemon."""
    return MockerConfig(
        num_gpu_blocks=ns.num_gpu_blocks,
        block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enable_prefix_caching=ns.enable_prefix_caching,
        watermark=ns.watermark,
        scheduling_policy=getattr(ns, "scheduling_policy", POLICY_FCFS),
        speedup_ratio=ns.speedup_ratio,
        data_parallel_size=ns.data_parallel_size,
        vocab_size=DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size,
        eos_token_ids=tuple(eos_token_ids or ()),
        context_length=context_length or 0,
        num_host_blocks=ns.num_host_blocks,
        num_disk_blocks=ns.num_disk_blocks,
        disk_cache_dir=ns.disk_cache_dir,
        disk_cache_persist=ns.disk_cache_persist,
        disk_io_queue_blocks=getattr(ns, "disk_io_queue_blocks", DEFAULT_DISK_IO_QUEUE_BLOCKS),
        kv_bytes_per_token=getattr(ns, "kv_bytes_per_token", None) or DEFAULT_KV_BYTES_PER_TOKEN,
        host_offload_d2h_bandwidth_gbps=ns.host_offload_d2h_bandwidth_gbps,
        host_offload_h2d_bandwidth_gbps=ns.host_offload_h2d_bandwidth_gbps,
        disk_offload_write_bandwidth_gbps=ns.disk_offload_write_bandwidth_gbps,
        disk_offload_read_bandwidth_gbps=ns.disk_offload_read_bandwidth_gbps,
        max_pinned_fraction=getattr(ns, "max_pinned_fraction", DEFAULT_MAX_PINNED_FRACTION),
        encode_ms_per_image_token=getattr(ns, "encode_ms_per_image_token", DEFAULT_ENCODE_MS_PER_IMAGE_TOKEN),
    )
