"""Mooncake-format request traces: one JSON object per line.

``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``: each hash
id stands for one block of ``trace_block_size`` prompt tokens (the last block may be partial) and
equal leading ids mean a shared prefix. We turn ids back into token ids deterministically so that
equal ids give equal tokens (and so equal KV block hashes) and different ids never collide.

A request keeps its hash ids, not its tokens: the prompts of a 12k-request trace are 145 million
tokens, over a gigabyte as Python lists. ``TraceRequest.prompt`` builds them when the request
arrives (tens of microseconds), and the replay drops them once the router and the engine have
them. Every hash id is checked when the trace is read, so a built prompt is always in vocabulary.

Images (multimodal traces): a record may carry ``"images": [{"offset": 40, "tokens": 256, "id": 7},
...]``: each image's placeholder tokens start at prompt position ``offset`` and number ``tokens``
(or are derived from ``"width"`` and ``"height"`` by Qwen2-VL's processor rules, its default pixel
budget); ``id`` names the image's content, so records with the same id show the same picture (a KV
cache hit where its position and prefix repeat) and different ids different pictures even at the
same size. The image's tokens are one placeholder id (the vocabulary's last), as a real processor
writes them, and the image's content key goes into the blocks covering it (shared/kv/hashing.py),
exactly as for a live request; the mocker also charges the encoder's time for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from dynamod.daemon.frontend.preprocess.media.processor import Qwen2VLRules
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol.llm import MultimodalItem

_QWEN2_VL = Qwen2VLRules()


class TraceImage(msgspec.Struct, forbid_unknown_fields=True):
    """One image of a trace record: where its placeholder tokens start, how many (or its size in
    pixels), and its content id."""

    offset: int
    id: int | str
    tokens: int | None = None
    width: int | None = None
    height: int | None = None

    def num_tokens(self) -> int:
        if self.tokens is not None:
            return self.tokens
        if self.width is None or self.height is None:
            raise ValueError("an image needs 'tokens' or 'width' and 'height'")
        h, w = _QWEN2_VL.resize(self.height, self.width)
        return _QWEN2_VL.num_tokens(h, w)


class TraceRecord(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    images: list[TraceImage] | None = None


@dataclass(slots=True)
class TraceRequest:
    index: int
    arrival_ms: float
    hash_ids: list[int]
    input_length: int
    output_length: int
    block_size: int  # tokens per hash id
    vocab_size: int
    images: list[MultimodalItem] | None = None  # where the prompt's images are, with their content keys

    @property
    def prompt(self) -> list[int]:
        """The prompt's token ids, built anew on each call (see the module docstring).

        Each hash id is one block: its first token carries the id's high part (``id //
        vocab_size``), the others its low part. That is unique per id below ``vocab_size**2``;
        the router and the engine chain block hashes by position, so repeated tokens inside a
        block are harmless."""
        hi_lo = [divmod(hid, self.vocab_size) for hid in self.hash_ids]
        tail = self.block_size - 1
        prompt: list[int] = []
        append, extend = prompt.append, prompt.extend
        for hi, lo in hi_lo:
            append(hi)
            extend([lo] * tail)
        del prompt[self.input_length :]  # the last block is partial when input_length is not a multiple
        if self.images:
            pad = self.vocab_size - 1
            for image in self.images:
                prompt[image.offset : image.offset + image.length] = [pad] * image.length
        return prompt


def load_trace(path: str | Path) -> list[TraceRecord]:
    """Reads and validates a trace; a bad line gives its line number."""
    decoder = msgspec.json.Decoder(TraceRecord)
    records: list[TraceRecord] = []
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read trace {path}: {exc.strerror}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidRequestError(f"{path}:{lineno}: not a trace record: {exc}") from None
        if rec.input_length < 1 or rec.output_length < 1 or not rec.hash_ids:
            raise InvalidRequestError(f"{path}:{lineno}: input_length, output_length and hash_ids must be non-empty")
        records.append(rec)
    if not records:
        raise InvalidRequestError(f"trace {path} has no requests")
    return records


def trace_images(index: int, rec: TraceRecord) -> list[MultimodalItem] | None:
    """A record's images as the prompt's ``MultimodalItem`` list (None without images); an image
    out of the prompt, overlapping another or without a size is an error naming the record."""
    if not rec.images:
        return None
    items: list[MultimodalItem] = []
    end = 0
    for j, image in enumerate(sorted(rec.images, key=lambda im: im.offset)):
        try:
            length = image.num_tokens()
        except ValueError as exc:
            raise InvalidRequestError(f"record {index}: images[{j}]: {exc}") from None
        if image.offset < end or length < 1 or image.offset + length > rec.input_length:
            raise InvalidRequestError(
                f"record {index}: images[{j}] (offset {image.offset}, {length} tokens) must lie within the "
                f"{rec.input_length}-token prompt, after the previous image"
            )
        end = image.offset + length
        items.append(MultimodalItem(mm_hash=f"trace-image-{image.id}", offset=image.offset, length=length,
                                    width=image.width or 0, height=image.height or 0))
    return items


def check_hash_id(hash_id: int, vocab_size: int) -> None:
    """Raises ``InvalidRequestError`` for an id whose tokens would fall outside the vocabulary."""
    if hash_id < 0:
        raise InvalidRequestError(f"hash id {hash_id} is negative")
    if hash_id // vocab_size >= vocab_size:
        raise InvalidRequestError(f"hash id {hash_id} is too large for a vocabulary of {vocab_size}")


def build_requests(
    records: list[TraceRecord], *, trace_block_size: int, vocab_size: int, arrival_speedup: float = 1.0
) -> list[TraceRequest]:
    if arrival_speedup <= 0:
        raise InvalidRequestError(f"--arrival-speedup must be positive, got {arrival_speedup}")
    out: list[TraceRequest] = []
    for i, rec in enumerate(records):
        for hid in rec.hash_ids:
            check_hash_id(hid, vocab_size)
        if rec.input_length > len(rec.hash_ids) * trace_block_size:
            raise InvalidRequestError(
                f"record {i}: input_length {rec.input_length} exceeds {len(rec.hash_ids)} blocks of {trace_block_size}"
            )
        out.append(TraceRequest(i, rec.timestamp / arrival_speedup, rec.hash_ids, rec.input_length,
                                rec.output_length, trace_block_size, vocab_size, trace_images(i, rec)))
    out.sort(key=lambda r: (r.arrival_ms, r.index))
    return out
