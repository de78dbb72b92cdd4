"""Seeded synthetic request traces in Mooncake format, for benchmarks that must not be tuned to one trace.

    python bench/traces.py bursty|diurnal|steady|conversation [--seed N] [--out FILE.jsonl]
                           [--duration S] [--rate R] [--requests N]

Writes one JSON object per line (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``:
one id per 512-token block, the last possibly partial; equal leading ids are a shared prefix), the
format ``dynamod replay --trace`` reads, and prints a JSON summary of what it wrote (request count,
duration, mean ISL/OSL, requests per minute at the quietest and busiest minute, and the prefix hit
rate an infinite cache would get). ``generate(kind, seed=..., **overrides)`` returns the records.

The kinds, each a different shape of load so a planner or a router is checked on more than one:

- ``bursty``: code completion. A base rate with on/off bursts of 10-40x it lasting 30 s to 3 min,
  quiet gaps between them; prompts 1-8k tokens built on a repository's context (a burst is a team
  or a CI job hammering a few repositories), outputs 10-200 tokens.
- ``diurnal``: a smooth day compressed into ``duration``: the rate rises from a trough to a peak 8x
  higher and back (a raised cosine); document-QA prompts of 4-16k tokens on shared documents,
  outputs 50-300 tokens.
- ``steady``: Poisson arrivals at a constant rate one default mocker worker serves with room to
  spare; 1-3k-token chat prompts on a few system prompts, outputs 50-150.
- ``conversation``: multi-turn chat sessions arriving as a Poisson process; each turn's prompt is the
  whole conversation so far (system prompt, earlier turns and answers) plus a new user message, so
  later turns reuse the earlier turns' blocks; think time between turns. Defaults give about 12k
  requests in an hour, the size of Mooncake's conversation trace.

Rates are in requests per second. Every generator draws from its own ``random.Random(seed)``: the
same arguments always give the same file.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 512  # tokens per hash id, the Mooncake trace format's block


@dataclass(slots=True)
class _Ids:
    """Hands out fresh block ids, so unrelated content never shares a block."""

    next_id: int = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return out


@dataclass(slots=True)
class _Prefix:
    """A reusable block-aligned context (a repository, a document, a system prompt)."""

    ids: list[int]

    @property
    def tokens(self) -> int:
        return len(self.ids) * BLOCK


def _blocks(tokens: int) -> int:
    return max(1, math.ceil(tokens / BLOCK))


def _record(t_s: float, prefix_ids: list[int], input_length: int, output_length: int, ids: _Ids) -> dict[str, Any]:
    """A request whose prompt is ``prefix_ids`` (whole blocks, cut to the prompt) then fresh tokens."""
    shared = prefix_ids[: max(0, min(len(prefix_ids), (input_length - 1) // BLOCK))]
    fresh = _blocks(input_length) - len(shared)
    return {"timestamp": round(t_s * 1000.0, 3), "input_length": int(input_length),
            "output_length": int(max(1, output_length)), "hash_ids": shared + ids.take(fresh)}


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def _poisson_arrivals(rng: random.Random, rate_at: Callable[[float], float], peak: float,
                      start: float, end: float) -> Iterator[float]:
    """Arrival times of a Poisson process of rate ``rate_at(t)`` <= ``peak`` on [start, end), by thinning."""
    if peak <= 0:
        return
    t = start
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            return
        if rng.random() * peak < rate_at(t):
            yield t


# ---- the kinds ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Burst:
    start_s: float
    length_s: float
    multiplier: float
    hot: tuple[int, ...]  # the repositories this burst hammers


def bursty(seed: int = 0, duration: float = 1200.0, rate: float = 1.2, repos: int = 400,
           gap_mean_s: float = 300.0) -> list[dict[str, Any]]:
    """See the module docstring; ``rate`` is the base rate between bursts."""
    rng = random.Random(seed)
    ids = _Ids()
    contexts = [_Prefix(ids.take(16)) for _ in range(repos)]  # 8k tokens of repository context each
    bursts: list[Burst] = []
    t = rng.uniform(30.0, 120.0)
    while t < duration:
        length = rng.uniform(30.0, 180.0)
        bursts.append(Burst(t, length, rng.uniform(10.0, 40.0), tuple(rng.sample(range(repos), 3))))
        t += length + rng.expovariate(1.0 / gap_mean_s)

    def burst_at(at: float) -> Burst | None:
        for b in bursts:
            if b.start_s <= at < b.start_s + b.length_s:
                return b
        return None

    def rate_at(at: float) -> float:
        b = burst_at(at)
        return rate * (b.multiplier if b else 1.0)

    peak = rate * max([b.multiplier for b in bursts] + [1.0])
    out = []
    for at in _poisson_arrivals(rng, rate_at, peak, 0.0, duration):
        b = burst_at(at)
        repo = rng.choice(b.hot) if b and rng.random() < 0.7 else rng.randrange(repos)
        isl = _lognormal_int(rng, 4500.0, 0.45, 1024, 8192)
        used = contexts[repo].ids[: int(isl * rng.uniform(0.2, 0.7)) // BLOCK]
        out.append(_record(at, used, isl, _lognormal_int(rng, 60.0, 0.7, 10, 200), ids))
    return out


def diurnal(seed: int = 0, duration: float = 1200.0, rate: float = 1.0, peak_ratio: float = 16.0,
            documents: int = 4000) -> list[dict[str, Any]]:
    """See the module docstring; ``rate`` is the trough's rate, the peak is ``peak_ratio`` times it."""
    rng = random.Random(seed)
    ids = _Ids()
    docs = [_Prefix(ids.take(rng.randint(8, 28))) for _ in range(documents)]
    popularity = [1.0 / (i + 1) for i in range(documents)]  # Zipf: a few documents are asked about most

    def rate_at(at: float) -> float:
        return rate * (1.0 + (peak_ratio - 1.0) * (1.0 - math.cos(2.0 * math.pi * at / duration)) / 2.0)

    out = []
    for at in _poisson_arrivals(rng, rate_at, rate * peak_ratio, 0.0, duration):
        doc = docs[rng.choices(range(documents), weights=popularity)[0]]
        question = _lognormal_int(rng, 300.0, 0.6, 40, 2000)
        isl = min(16384, max(4096, doc.tokens + question))
        out.append(_record(at, doc.ids, isl, _lognormal_int(rng, 120.0, 0.5, 50, 300), ids))
    return out


def steady(seed: int = 0, duration: float = 900.0, rate: float = 4.0, system_prompts: int = 4) -> list[dict[str, Any]]:
    """See the module docstring."""
    rng = random.Random(seed)
    ids = _Ids()
    systems = [_Prefix(ids.take(2)) for _ in range(system_prompts)]
    out = []
    for at in _poisson_arrivals(rng, lambda _t: rate, rate, 0.0, duration):
        isl = _lognormal_int(rng, 1800.0, 0.3, 1024, 3072)
        out.append(_record(at, rng.choice(systems).ids, isl, _lognormal_int(rng, 90.0, 0.3, 50, 150), ids))
    return out


@dataclass(slots=True)
class _Session:
    """One conversation: its blocks so far and how many tokens they hold (the last block may be partial)."""

    ids: list[int] = field(default_factory=list)
    tokens: int = 0

    def extend(self, tokens: int, ids: _Ids) -> None:
        """Append ``tokens`` of new content: a partial last block becomes a new block (new content)."""
        full = self.tokens // BLOCK
        del self.ids[full:]
        self.tokens += tokens
        self.ids += ids.take(_blocks(self.tokens) - full)


def conversation(seed: int = 0, duration: float = 3600.0, rate: float = 4.0, requests: int = 12000,
                 apps: int = 8) -> list[dict[str, Any]]:
    """See the module docstring; ``rate`` is requests per second over all sessions (sessions arrive
    at ``rate / mean turns``); stops at ``requests`` or ``duration``, whichever comes first."""
    rng = random.Random(seed)
    ids = _Ids()
    systems = [_Prefix(ids.take(rng.randint(2, 8))) for _ in range(apps)]
    mean_turns = 5.0
    out: list[dict[str, Any]] = []
    session_starts = list(_poisson_arrivals(rng, lambda _t: rate / mean_turns, rate / mean_turns, 0.0, duration))
    for start in session_starts:
        system = rng.choice(systems)
        session = _Session(list(system.ids), system.tokens)
        at = start
        turns = min(40, 1 + int(rng.expovariate(1.0 / (mean_turns - 1.0))))
        for _ in range(turns):
            if at >= duration:
                break
            session.extend(_lognormal_int(rng, 250.0, 1.0, 10, 6000), ids)  # the user's message
            isl = min(session.tokens, 131072)
            osl = _lognormal_int(rng, 250.0, 0.8, 8, 2000)
            out.append(_record(at, session.ids, isl, osl, ids) | {"hash_ids": list(session.ids)})
            session.extend(osl, ids)  # the answer becomes context of the next turn
            at += rng.expovariate(1.0 / 45.0) + osl * 0.03  # reading the answer, thinking, typing
    out.sort(key=lambda r: r["timestamp"])
    return out[:requests]


KINDS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "bursty": bursty, "diurnal": diurnal, "steady": steady, "conversation": conversation,
}


def generate(kind: str, seed: int = 0, **overrides: Any) -> list[dict[str, Any]]:
    """The records of one trace kind; ``overrides`` are the generator's keyword arguments."""
    if kind not in KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; choose one of {', '.join(KINDS)}")
    return KINDS[kind](seed=seed, **{k: v for k, v in overrides.items() if v is not None})


def write(records: list[dict[str, Any]], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What a reader needs to know a trace by: size, length, rates, ISL/OSL and reuse."""
    if not records:
        return {"requests": 0}
    end_s = records[-1]["timestamp"] / 1000.0
    per_minute: dict[int, int] = {}
    for r in records:
        minute = int(r["timestamp"] // 60000)
        per_minute[minute] = per_minute.get(minute, 0) + 1
    minutes = [per_minute.get(m, 0) for m in range(int(end_s // 60) + 1)]
    # Infinite cache: a full block hits when its id was seen before. An id here always follows the
    # same ids (a generator never reuses one elsewhere), so the id alone names its whole prefix.
    seen: set[int] = set()
    hit = total = 0
    for r in records:
        for hid in r["hash_ids"][: r["input_length"] // BLOCK]:
            total += 1
            if hid in seen:
                hit += 1
            else:
                seen.add(hid)
    n = len(records)
    return {
        "requests": n,
        "duration_s": round(end_s, 1),
        "mean_rate_per_s": round(n / end_s, 3) if end_s else None,
        "requests_per_minute": {"min": min(minutes), "max": max(minutes)},
        "isl_mean": round(sum(r["input_length"] for r in records) / n, 1),
        "osl_mean": round(sum(r["output_length"] for r in records) / n, 1),
        "infinite_cache_hit_rate": round(hit / total, 3) if total else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the trace here (JSONL); without it only the summary is printed")
    ap.add_argument("--duration", type=float, help="seconds of traffic [default: the kind's]")
    ap.add_argument("--rate", type=float, help="requests per second (base, trough or mean) [default: the kind's]")
    ap.add_argument("--requests", type=int, help="conversation: most requests [default 12000]")
    args = ap.parse_args(argv)
    overrides: dict[str, Any] = {"duration": args.duration, "rate": args.rate}
    if args.requests is not None:
        if args.kind != "conversation":
            ap.error("--requests is for the conversation kind")
        overrides["requests"] = args.requests
    for name in ("duration", "rate"):
        if overrides[name] is not None and overrides[name] <= 0:
            ap.error(f"--{name} must be positive")
    records = generate(args.kind, seed=args.seed, **overrides)
    if args.out:
        write(records, args.out)
    print(json.dumps({"kind": args.kind, "seed": args.seed, "out": args.out, **summary(records)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
