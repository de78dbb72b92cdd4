"""The tokenizer files a model card carries: the reference in the card and the copies in discovery.

A frontend must not open a path a worker names (the worker's disk is not the frontend's), so the
worker publishes the files' bytes (tokenizer.json, tokenizer_config.json, the chat template and the
small configs they depend on) as one compressed bundle under ``v1/mdc_files/{ns}/{sha256}/``, and
its card names the bundle by content hash (``ModelFilesRef``). Each copy of the bundle belongs to
one worker's lease: ``copies/{instance_id:x}`` -> ``ModelFilesCopy`` (this record, JSON), and
``chunks/{instance_id:x}/{index:05d}`` -> raw slices of the compressed bundle (etcd refuses requests
over 1.5 MiB by default, so a large tokenizer spans several keys). See
``shared/runtime/model_files.py`` for who writes and reads them.
"""

from __future__ import annotations

import msgspec

CODEC_ZLIB = "zlib"
BUNDLE_FORMAT = 1  # the uncompressed bundle: msgpack map {file name: bytes}, names sorted


class ModelFilesRef(msgspec.Struct, kw_only=True, omit_defaults=True):
    """In the card: which bundle holds this model's tokenizer files (``sha256`` of the
    uncompressed bundle, hex), its size, and the file names in it."""

    sha256: str
    size: int
    names: list[str] = []


class ModelFilesCopy(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One worker's copy of a bundle: how many chunks, how big, and how it is compressed."""

    sha256: str
    size: int  # uncompressed bytes
    compressed_size: int
    chunks: int
    codec: str = CODEC_ZLIB
    format: int = BUNDLE_FORMAT
    node: str = ""  # the holder's host name, for operators reading etcd


def encode_copy(copy: ModelFilesCopy) -> bytes:
    return msgspec.json.encode(copy)


def decode_copy(data: bytes) -> ModelFilesCopy:
    return msgspec.json.decode(data, type=ModelFilesCopy)
