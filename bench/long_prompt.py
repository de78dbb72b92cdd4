"""Long prompts through the frontend's request path: prints one JSON document.

    python bench/long_prompt.py [--tokens 32768] [--runs 60] [--workers 64]

A chat request whose conversation is ``--tokens`` tokens long (a system prompt, a long document
and a question) goes through what the frontend does before the engine sees it: the chat template
renders it, the tokenizer encodes it (``ModelPreprocessor``, the built-in ``tiny`` model's
byte-level BPE tokenizer), and the KV router hashes its blocks and picks a worker
(``KvRouter.select_worker``, 64 workers, an index where several workers cached earlier
conversations over the same documents). Target (router issue): the whole path in at most 2x the
time the tokenizer alone takes to encode the rendered prompt; ``ratio_p50`` / ``ratio_p99``
compare the two distributions, and each stage is reported alone.

``pipeline`` runs the stages back to back on this thread (CPU time is what the target is about);
``pipeline_async`` goes through ``ModelPreprocessor.chat_prompt`` as the frontend does (render and
encode hop to a worker thread for long prompts) and adds ``select_worker``. Figures on a shared
machine are noisy: ``cpu`` (process CPU time, the tokenizer's Rust threads included) excludes time
other processes held the cores, ``wall`` does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time

import msgspec
from prometheus_client import CollectorRegistry

from dynamod.daemon.frontend.openai.schema import ChatCompletionRequest
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.daemon.models.local import resolve_model
from dynamod.daemon.router.core import KvRouter, KvRouterConfig
from dynamod.shared.kv import indexer as kv_indexer
from dynamod.shared.kv.hashing import compute_block_hashes, compute_sequence_hashes, hash_tokens
from dynamod.shared.protocol.kv_events import KvStored, RouterEvent, StoredBlock
from dynamod.shared.protocol.model_card import ModelCard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import latency_summary  # noqa: E402

BLOCK_SIZE = 16
CHUNK_BLOCKS = 32
DOCUMENTS = 8






def words(rng: random.Random, n: int) -> str:
    """English-looking text (the tiny tokenizer was trained on English prose)."""
    vocab = (
        "the of and to in that he is for it with as his on be at by this had not are but from or have an "
        "they which one you were her all she there would their we him been has when who will more no if out "
        "so said what up its about into than them can only other new some could time these two may then do "
        "first any my now such like our over man me even most made after also did many before must through "
        "years where much your way well down should because each just those people how too little state "
        "good very make world still own see men work long get here between both life being under never day "
        "same another know while last might us great old year off come since against go came right used take "
        "kernel router worker cache block token prompt latency throughput 1024 2048 3.14 json {\"id\": 7}"
    ).split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def conversation(rng: random.Random, document: str) -> list[dict]:
    system = "You are a careful assistant. Answer from the document only.\n" + words(rng, 200)
    question = "Question: " + words(rng, 30) + "?"
    return [{"role": "system", "content": system}, {"role": "user", "content": document + "\n\n" + question}]


def make_documents(rng: random.Random, pre: ModelPreprocessor, target_tokens: int) -> list[str]:
    """Documents sized so that a whole conversation is about ``target_tokens`` tokens."""
    probe = words(rng, 4000)
    tokens_per_word = len(pre.tokenizer.encode(probe)) / 4000
    n_words = int((target_tokens - 400) / tokens_per_word)
    return [words(rng, n_words) for _ in range(DOCUMENTS)]


def cache_on(router: KvRouter, worker_id: int, event_id: int, tokens: list[int]) -> int:
    """The worker reports caching ``tokens`` (chunked KvStored events); returns the next event id."""
    local, seq = hash_tokens(tokens, BLOCK_SIZE)
    for lo in range(0, len(seq), CHUNK_BLOCKS):
        hi = min(lo + CHUNK_BLOCKS, len(seq))
        parent = None if lo == 0 else seq[lo - 1] ^ worker_id
        ev = KvStored(parent_hash=parent, blocks=[StoredBlock(seq[i] ^ worker_id, local[i]) for i in range(lo, hi)])
        router.apply_event(RouterEvent(worker_id=worker_id, dp_rank=0, event_id=event_id, event=ev))
        event_id += 1
    return event_id


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768, help="prompt length in tokens (approximately)")
    p.add_argument("--runs", type=int, default=60, help="requests timed")
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args()
    rng = random.Random(args.seed)

    model = resolve_model("tiny")
    pre = ModelPreprocessor.load(ModelCard(served_model_name="tiny", tokenizer_source=str(model.path)))
    template = pre.chat_template
    assert template is not None
    documents = make_documents(rng, pre, args.tokens)

    router = KvRouter(KvRouterConfig(), BLOCK_SIZE, rng=random.Random(1), registry=CollectorRegistry())
    workers = [0x100 + i for i in range(args.workers)]
    router.update_workers([(w, 0) for w in workers])
    event_ids = dict.fromkeys(workers, 0)
    for doc in documents:  # earlier conversations over each document, cached on a few workers
        for w in rng.sample(workers, 3):
            ids = pre._encode_now(template.render(conversation(rng, doc), add_generation_prompt=True), False)
            event_ids[w] = cache_on(router, w, event_ids[w], ids)

    requests = [
        msgspec.convert({"model": "tiny", "messages": conversation(rng, rng.choice(documents))}, ChatCompletionRequest)
        for _ in range(args.runs)
    ]
    tok_wall, tok_cpu, pipe_wall, pipe_cpu = [], [], [], []
    render_s, hash_s, route_s, async_wall = [], [], [], []
    prompt_tokens = 0
    for i, req in enumerate(requests):
        # The pipeline, stage by stage.
        c0 = time.process_time()
        t0 = time.perf_counter()
        text = template.render(req.messages, add_generation_prompt=True, tools=None, template_kwargs=None)
        t1 = time.perf_counter()
        ids = pre._encode_now(text, False)
        t2 = time.perf_counter()
        decision = router.select_worker(f"r{i}", ids)
        t3 = time.perf_counter()
        pipe_cpu.append(time.process_time() - c0)
        pipe_wall.append(t3 - t0)
        render_s.append(t1 - t0)
        route_s.append(t3 - t2)
        router.free(decision.request_id)
        prompt_tokens = len(ids)
        # The tokenizer alone, on the same rendered text.
        c0 = time.process_time()
        t0 = time.perf_counter()
        pre._encode_now(text, False)
        tok_wall.append(time.perf_counter() - t0)
        tok_cpu.append(time.process_time() - c0)
        # Hashing alone (inside select_worker above).
        t0 = time.perf_counter()
        compute_sequence_hashes(compute_block_hashes(ids, BLOCK_SIZE))
        hash_s.append(time.perf_counter() - t0)

    async def through_frontend() -> None:
        for i, req in enumerate(requests):
            t0 = time.perf_counter()
            ids = await pre.chat_prompt(req)
            decision = router.select_worker(f"a{i}", ids)
            async_wall.append(time.perf_counter() - t0)
            router.free(decision.request_id)

    asyncio.run(through_frontend())

    out = {
        "python": platform.python_version(),
        "kv_index": getattr(kv_indexer, "kv_index_implementation", lambda: "python")(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "prompt_tokens": prompt_tokens,
        "prompt_blocks": prompt_tokens // BLOCK_SIZE,
        "workers": args.workers,
        "tokenizer_alone_wall": latency_summary(tok_wall, unit="ms", digits=3, with_max=False),
        "tokenizer_alone_cpu": latency_summary(tok_cpu, unit="ms", digits=3, with_max=False),
        "pipeline_wall": latency_summary(pipe_wall, unit="ms", digits=3, with_max=False),
        "pipeline_cpu": latency_summary(pipe_cpu, unit="ms", digits=3, with_max=False),
        "pipeline_async_wall": latency_summary(async_wall, unit="ms", digits=3, with_max=False),
        "stages_wall": {"template": latency_summary(render_s, unit="ms", digits=3, with_max=False), "hash": latency_summary(hash_s, unit="ms", digits=3, with_max=False), "select_worker": latency_summary(route_s, unit="ms", digits=3, with_max=False)},
    }
    for kind in ("wall", "cpu"):
        pipe, tok = out[f"pipeline_{kind}"], out[f"tokenizer_alone_{kind}"]
        out[f"ratio_p50_{kind}"] = round(pipe["p50_ms"] / tok["p50_ms"], 3)
        out[f"ratio_p99_{kind}"] = round(pipe["p99_ms"] / tok["p99_ms"], 3)
    out["target_ratio"] = 2.0
    out["target_met_cpu"] = out["ratio_p50_cpu"] <= 2.0 and out["ratio_p99_cpu"] <= 2.0
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
