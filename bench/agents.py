"""Agent sessions: what session affinity and pinned prefixes buy a fleet serving tool loops. Prints JSON.

    python bench/agents.py [--sessions 16] [--workers 4] [--configs round-robin,kv,kv+session,kv+session+pin]
                           [--min-turns 5] [--max-turns 20] [--time-scale 1] [--speedup 1] [--seed 0] [--quick]

The workload (seeded, the same for every configuration): ``--sessions`` concurrent agent sessions.
Each belongs to one of ``--agent-kinds`` agents (a system prompt and tool definitions the sessions of
that agent share) and has its own notes after them (the rest of its system prompt) and a task. A
session is a tool loop of ``--min-turns``..``--max-turns`` requests: each turn streams the
assistant's answer, then the agent "runs a tool" (a seeded call and a seeded output of
``--tool-output-tokens`` tokens) and, after a think time of ``--think`` seconds x ``--time-scale``,
sends the next turn with the context grown by the assistant's text, the tool call and its result.
The mocker's answer is random text: the bench sends it back as the assistant's turn, beside the
tool call the agent's plan says it made (an agent whose model called that tool). A session's turn
count is cut so that its context stays under ``--max-context`` tokens (the tiny model's is 8192).

Every configuration runs on a fresh cluster of real processes (``disagg_serving.Cluster``: a
frontend and ``--workers`` mocker workers, file discovery, ZMQ KV events) whose workers' KV cache
(``--num-gpu-blocks`` x ``--block-size``) is small enough that sessions compete for it. Every
request is a streamed ``/v1/messages`` call (the Anthropic Messages API):

- ``round-robin``: the frontend takes turns over the workers;
- ``kv``: KV-aware routing (prefix overlap and load);
- ``kv+session``: KV routing plus session affinity (the ``x-dynamo-session-id`` header);
- ``kv+session+pin``: as ``kv+session``, and the requests mark the agent's tool definitions and the
  session's system prompt with ``cache_control: {"type": "ephemeral", "ttl": "5m"}`` (on the last
  tool and the last system block; Anthropic's prefix order is tools then system, the tiny chat
  template's is system text then tools), asking the workers to pin that prefix. A server that pins
  reports ``cache_creation_input_tokens`` > 0 on the request that wrote the pin; when no response
  of the run does, ``pinning.reported`` is false (with a note) and the figures are those of an
  unpinned run.

Per configuration: requests and ``failed`` (HTTP errors, stream ``error`` events, a stream without
``message_stop``), the prefix hit rate (``cache_read_input_tokens`` over the prompt tokens the
responses report, and the same ratio from the frontend's ``dynamo_frontend_cached_tokens`` and
``dynamo_frontend_prompt_tokens`` counters), TTFT p50/p99 (client-side: request sent to the
first ``content_block_delta``), ``wall_s`` (first request sent to last stream ended), and worker
time two ways: ``fleet_worker_s`` = ``wall_s`` x workers (what the fleet costs for the run) and
``busy_worker_s`` = the sum over workers of the time at least one request was in flight on that
worker (the union of its requests' send-to-end intervals, as the client saw them; the worker of a
request is its ``x-dynamo-worker-instance-id`` response header). Also how many workers a session
touched (``workers_per_session_mean``), how the sessions' first turns and all requests spread over
the workers, the router's session outcomes from its metrics, and ``session_prefix_ceiling``: the
share of prompt tokens that repeat the same session's previous prompt in whole blocks (a turn's
prompt starts with the previous one), the hit rate of a cache that kept every session's last
prompt, before sharing between sessions of one agent (which can add to it).
Each run also prints its configuration's figures to stderr as one line as soon as it ends.

``--quick`` (a few seconds a configuration): 4 sessions of 3-4 turns on 2 workers, think times
x 0.05, mocker at 20x; it checks the bench end to end, its figures mean little.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import calibrate, percentiles  # noqa: E402
from disagg_serving import Cluster  # noqa: E402

MODEL = "tiny"
PIN = {"type": "ephemeral", "ttl": "5m"}
SESSION_HEADER = "x-dynamo-session-id"
WORKER_HEADER = "x-dynamo-worker-instance-id"


@dataclass(frozen=True, slots=True)
class RunConfig:
    """One way of serving the workload."""

    name: str
    router_mode: str
    session: bool  # send x-dynamo-session-id
    pin: bool  # mark the system prompt and tool definitions with cache_control


CONFIGS = {
    c.name: c
    for c in (
        RunConfig("round-robin", "round-robin", session=False, pin=False),
        RunConfig("kv", "kv", session=False, pin=False),
        RunConfig("kv+session", "kv", session=True, pin=False),
        RunConfig("kv+session+pin", "kv", session=True, pin=True),
    )
}


# ------------------------------------------------------------------------------------------------
# The workload.


class TokenCounter:
    """Token counts of the served model's tokenizer (the tiny model's), so the planned sizes are
    the sizes the workers see."""

    def __init__(self) -> None:
        self._tok = Tokenizer.from_dir(TINY_MODEL_DIR)

    def __call__(self, text: str) -> int:
        return len(self._tok.encode(text))


WORDS = ("alpha river stone light green house table cloud music paper north quiet bread glass horse field "
         "dream water tower smile worker cache route block token stream queue batch frame index order").split()
PATHS = ("src/router/core.py", "src/worker/service.py", "tests/test_cache.py", "lib/queue.rs", "docs/api.md",
         "src/engine/scheduler.py", "src/http/server.go", "config/cluster.yaml")


class TextMaker:
    """Seeded text: prose for prompts and notes, tool-output-like lines (file listings, grep
    hits, test logs) for tool results; each piece cut to a token budget."""

    def __init__(self, rng: random.Random, count: TokenCounter) -> None:
        self.rng = rng
        self.count = count

    def sentence(self) -> str:
        words = [self.rng.choice(WORDS) for _ in range(self.rng.randint(6, 14))]
        return " ".join(words).capitalize() + "."

    def line(self) -> str:
        r = self.rng
        kind = r.randrange(4)
        path = r.choice(PATHS)
        if kind == 0:
            return f"{path}:{r.randint(1, 900)}: {' '.join(r.choice(WORDS) for _ in range(r.randint(3, 8)))}"
        if kind == 1:
            return f"-rw-r--r-- 1 agent agent {r.randint(100, 99999):>6} {path}"
        if kind == 2:
            return f"{r.choice(('PASSED', 'FAILED', 'SKIPPED'))} tests/test_{r.choice(WORDS)}.py::test_{r.choice(WORDS)}"
        return f"    {r.choice(WORDS)}_{r.choice(WORDS)} = {r.randint(0, 4096)}  # {r.choice(WORDS)}"

    def fill(self, tokens: int, piece: str = "sentence", sep: str = " ") -> str:
        """Pieces joined until about ``tokens`` tokens (measured, so the budget holds)."""
        make = self.sentence if piece == "sentence" else self.line
        parts: list[str] = []
        # Measure in steps: about 8 pieces at a time, then check.
        while True:
            parts.extend(make() for _ in range(8))
            text = sep.join(parts)
            n = self.count(text)
            if n >= tokens:
                while len(parts) > 1 and self.count(sep.join(parts[:-1])) >= tokens:
                    parts.pop()
                return sep.join(parts)


@dataclass(frozen=True, slots=True)
class Turn:
    think_s: float  # wait before sending this turn (turn 0: the session's start offset)
    max_tokens: int
    tool_name: str = ""  # the tool the agent runs on this turn's answer ("" on the last turn)
    tool_input: dict[str, Any] = field(default_factory=dict)
    tool_output: str = ""


@dataclass(frozen=True, slots=True)
class SessionPlan:
    session_id: str
    agent: int
    tools: list[dict[str, Any]]
    system: list[str]  # the agent's instructions, then the session's own notes
    task: str
    turns: list[Turn]
    context_tokens_est: int  # the last turn's prompt, as planned (the assistant's text estimated)


@dataclass(frozen=True, slots=True)
class Workload:
    sessions: list[SessionPlan]

    def summary(self) -> dict[str, Any]:
        turns = [len(s.turns) for s in self.sessions]
        ctx = [s.context_tokens_est for s in self.sessions]
        return {"sessions": len(turns), "requests": sum(turns), "turns_min": min(turns), "turns_max": max(turns),
                "final_context_tokens_est_max": max(ctx), "final_context_tokens_est_mean": round(sum(ctx) / len(ctx))}


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    count = TokenCounter()
    text = TextMaker(rng, count)
    agents = []
    for a in range(args.agent_kinds):
        tools = []
        for t in range(rng.randint(4, 6)):
            props = {f"{rng.choice(WORDS)}_{k}": {"type": rng.choice(("string", "integer", "boolean")),
                                                  "description": " ".join(rng.choice(WORDS) for _ in range(4))}
                     for k in range(rng.randint(2, 4))}
            tools.append({"name": f"agent{a}_{rng.choice(WORDS)}_{t}", "description": text.fill(30),
                          "input_schema": {"type": "object", "properties": props, "required": list(props)[:1]}})
        agents.append((tools, f"You are agent {a}. " + text.fill(args.system_tokens)))
    lo_think, hi_think = args.think
    lo_out, hi_out = args.tool_output_tokens
    lo_ans, hi_ans = args.answer_tokens
    sessions = []
    for i in range(args.sessions):
        agent = rng.randrange(args.agent_kinds)
        tools, instructions = agents[agent]
        notes = f"Session {i} notes. " + text.fill(args.notes_tokens)
        task = f"Task {i}: " + text.fill(60)
        # Planned context: the rendered tools and system prompt, then per turn the answer (the
        # mocker's random tokens come back as text that retokenizes to ~1.5x as many), the tool
        # call and its output, and the turns' headers.
        context = count(instructions) + count(notes) + count(json.dumps(tools)) + count(task) + 60
        wanted = rng.randint(args.min_turns, args.max_turns)
        turns: list[Turn] = []
        final_prompt = context
        think = rng.uniform(0, hi_think) * args.time_scale  # the session's start offset
        for t in range(wanted):
            max_tokens = rng.randint(lo_ans, hi_ans)
            last = t == wanted - 1
            tool = rng.choice(tools)
            step_in = {k: rng.randint(0, 99) if v["type"] == "integer" else (rng.random() < 0.5 if v["type"] == "boolean"
                       else rng.choice(PATHS)) for k, v in tool["input_schema"]["properties"].items()}
            output = "" if last else text.fill(rng.randint(lo_out, hi_out), piece="line", sep="\n")
            if t > 0 and context + max_tokens > args.max_context:
                break  # this turn would not fit: the session ends with the previous one
            turns.append(Turn(think, max_tokens, "" if last else tool["name"], step_in if not last else {}, output))
            final_prompt = context
            context += max_tokens * 3 // 2 + count(json.dumps(step_in)) + count(output) + 40
            think = rng.uniform(lo_think, hi_think) * args.time_scale
        if turns[-1].tool_name:  # cut short: the last planned turn is the final answer, no tool after it
            last_turn = turns[-1]
            turns[-1] = Turn(last_turn.think_s, last_turn.max_tokens)
        sessions.append(SessionPlan(f"agent-{args.seed}-{i}", agent, tools, [instructions, notes], task, turns,
                                    final_prompt))
    return Workload(sessions)


def request_body(plan: SessionPlan, history: list[dict[str, Any]], turn: Turn, pin: bool) -> dict[str, Any]:
    """The turn's ``/v1/messages`` body. With ``pin``, ``cache_control`` marks the last tool
    definition and the last system block, so the pinned prefix covers both whatever order the
    chat template renders them in."""
    tools = [dict(t) for t in plan.tools]
    system: list[dict[str, Any]] = [{"type": "text", "text": s} for s in plan.system]
    if pin:
        tools[-1]["cache_control"] = PIN
        system[-1]["cache_control"] = PIN
    return {"model": MODEL, "max_tokens": turn.max_tokens, "stream": True, "system": system, "tools": tools,
            "messages": [{"role": "user", "content": plan.task}, *history],
            # Every answer is max_tokens long (the mocker samples an end token now and then), so
            # every configuration sends the same token counts.
            "nvext": {"ignore_eos": True}}


# ------------------------------------------------------------------------------------------------
# One streamed request.


@dataclass(slots=True)
class Outcome:
    session: int
    turn: int
    ok: bool
    sent: float = 0.0  # perf_counter
    ended: float = 0.0
    ttft_s: float | None = None
    text: str = ""
    worker: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    error: str = ""


async def stream_message(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str],
                         out: Outcome) -> None:
    """Sends one streamed ``/v1/messages`` request and reads its events into ``out``."""
    out.sent = time.perf_counter()
    parts: list[str] = []
    stopped = False
    try:
        async with client.stream("POST", "/v1/messages", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200].decode(errors='replace')}"
                return
            out.worker = resp.headers.get(WORKER_HEADER, "")
            event = ""
            async for line in resp.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                    continue
                if not line.startswith("data: "):
                    continue
                data = json.loads(line[6:])
                if event == "content_block_delta":
                    if out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - out.sent
                    delta = data["delta"]
                    if delta.get("type") == "text_delta":
                        parts.append(delta["text"])
                elif event == "message_delta":
                    out.usage = {k: int(v) for k, v in data.get("usage", {}).items() if isinstance(v, int)}
                elif event == "message_stop":
                    stopped = True
                elif event == "error":
                    out.error = f"stream error: {data.get('error', {}).get('message', '')[:200]}"
                    return
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        out.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        return
    finally:
        out.ended = time.perf_counter()
    if not stopped:
        out.error = "the stream ended without message_stop"
        return
    out.text = "".join(parts)
    out.ok = True


async def run_session(client: httpx.AsyncClient, index: int, plan: SessionPlan, config: RunConfig,
                      outcomes: list[Outcome]) -> None:
    """The session's tool loop; a failed turn ends it (the next turn would need its answer)."""
    history: list[dict[str, Any]] = []
    headers = {SESSION_HEADER: plan.session_id} if config.session else {}
    for t, turn in enumerate(plan.turns):
        await asyncio.sleep(turn.think_s)
        out = Outcome(index, t, ok=False)
        outcomes.append(out)
        await stream_message(client, request_body(plan, history, turn, config.pin), headers, out)
        if not out.ok:
            return
        if not turn.tool_name:
            return
        call_id = f"toolu_{index}_{t}"
        content: list[dict[str, Any]] = [{"type": "text", "text": out.text}] if out.text.strip() else []
        content.append({"type": "tool_use", "id": call_id, "name": turn.tool_name, "input": turn.tool_input})
        history.append({"role": "assistant", "content": content})
        history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                                    "content": turn.tool_output}]})


# ------------------------------------------------------------------------------------------------
# A configuration's run.


class AgentCluster(Cluster):
    """``disagg_serving.Cluster`` (a frontend and aggregated mocker workers as real processes on
    free ports) with this configuration's router flags on the frontend; argparse keeps the last
    ``--router-mode`` given, so they override the base class's ``kv``."""

    def __init__(self, args: argparse.Namespace, router_mode: str) -> None:
        frontend_args = " ".join(["--router-mode", router_mode, *args.frontend_args.split()])
        worker_args = f"--block-size {args.block_size} --num-gpu-blocks {args.num_gpu_blocks} {args.worker_args}"
        super().__init__(f"agg:{args.workers}",
                         argparse.Namespace(serving_speedup=args.speedup, serving_worker_args=worker_args.strip(),
                                            serving_frontend_args=frontend_args))


def scrape_metrics(url: str) -> dict[str, float]:
    """The frontend's counters this bench reads, summed over their other labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^(dynamo_frontend_(?:prompt|cached)_tokens_total)\{[^}]*\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    for m in re.finditer(r'^dynamo_router_sessions_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M):
        key = f"session_{m.group(1)}"
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total = 0.0
    end = float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def prompt_tokens(o: Outcome) -> int:
    """The request's whole prompt: Anthropic splits it into input, cache read and cache written."""
    u = o.usage
    return u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0) + u.get("cache_creation_input_tokens", 0)


def session_ceiling(ok: list[Outcome], block_size: int) -> float:
    """The share of prompt tokens that repeat the same session's previous prompt, in whole blocks:
    a turn's prompt starts with the previous turn's (its history, then the assistant header the
    answer follows), so this is the hit rate of a cache that kept every session's last prompt,
    before any sharing between sessions of one agent (which can add to it)."""
    last: dict[int, int] = {}
    reusable = total = 0
    for o in sorted(ok, key=lambda o: (o.session, o.turn)):
        n = prompt_tokens(o)
        if o.session in last:
            reusable += min(last[o.session], n - 1) // block_size * block_size
        last[o.session] = n
        total += n
    return round(reusable / total, 4) if total else 0.0


def summarize(config: RunConfig, outcomes: list[Outcome], workers: int, block_size: int,
              metrics: dict[str, float]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    read = sum(o.usage.get("cache_read_input_tokens", 0) for o in ok)
    created = sum(o.usage.get("cache_creation_input_tokens", 0) for o in ok)
    prompt = sum(prompt_tokens(o) for o in ok)
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    p50, p99 = percentiles(ttft, (0.5, 0.99))
    warm = [o.ttft_s for o in ok if o.ttft_s is not None and o.turn > 0]
    w50, w99 = percentiles(warm, (0.5, 0.99))
    wall = max((o.ended for o in outcomes), default=0.0) - min((o.sent for o in outcomes), default=0.0)
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for o in ok:
        by_worker.setdefault(o.worker, []).append((o.sent, o.ended))
    per_session: dict[int, set[str]] = {}
    first_worker: dict[str, int] = {}
    for o in ok:
        per_session.setdefault(o.session, set()).add(o.worker)
        if o.turn == 0:
            first_worker[o.worker] = first_worker.get(o.worker, 0) + 1
    prompt_m = metrics.get("dynamo_frontend_prompt_tokens_total", 0.0)
    out: dict[str, Any] = {
        "router_mode": config.router_mode, "session_header": config.session, "cache_control": config.pin,
        "requests": len(outcomes), "failed": len(failed),
        "prefix_hit_rate": round(read / prompt, 4) if prompt else 0.0,
        "prefix_hit_rate_frontend_metrics": round(metrics.get("dynamo_frontend_cached_tokens_total", 0.0) / prompt_m, 4)
        if prompt_m else None,
        "session_prefix_ceiling": session_ceiling(ok, block_size),
        "prompt_tokens": prompt, "prompt_tokens_max": max((prompt_tokens(o) for o in ok), default=0),
        "cache_read_input_tokens": read, "cache_creation_input_tokens": created,
        "output_tokens": sum(o.usage.get("output_tokens", 0) for o in ok),
        "ttft_ms_p50": round(p50 * 1e3, 1), "ttft_ms_p99": round(p99 * 1e3, 1),
        "ttft_ms_p50_after_first_turn": round(w50 * 1e3, 1), "ttft_ms_p99_after_first_turn": round(w99 * 1e3, 1),
        "wall_s": round(wall, 2), "fleet_worker_s": round(wall * workers, 2),
        "busy_worker_s": round(sum(busy_seconds(v) for v in by_worker.values()), 2),
        "workers_used": len(by_worker),
        # How the sessions' first turns spread (largest first) and each worker's requests.
        "sessions_started_per_worker": sorted(first_worker.values(), reverse=True),
        "requests_per_worker": sorted((len(v) for v in by_worker.values()), reverse=True),
        "workers_per_session_mean": round(sum(len(v) for v in per_session.values()) / len(per_session), 2)
        if per_session else 0.0,
        "router_sessions": {k.removeprefix("session_"): int(v) for k, v in sorted(metrics.items()) if k.startswith("session_")},
    }
    if config.pin:
        out["pinning"] = {"requested": True, "reported": created > 0}
        if not created:
            out["pinning"]["note"] = ("no response reported cache_creation_input_tokens > 0: the server pinned "
                                      "nothing, so this run is kv+session with cache_control blocks")
    if failed:
        samples: dict[str, int] = {}
        for o in failed:
            samples[o.error] = samples.get(o.error, 0) + 1
        out["error_samples"] = dict(sorted(samples.items(), key=lambda kv: -kv[1])[:5])
    return out


async def run_config(args: argparse.Namespace, config: RunConfig, workload: Workload) -> dict[str, Any]:
    cluster = AgentCluster(args, config.router_mode)
    try:
        await asyncio.to_thread(cluster.wait_ready)
        outcomes: list[Outcome] = []
        limits = httpx.Limits(max_connections=len(workload.sessions), max_keepalive_connections=len(workload.sessions))
        async with httpx.AsyncClient(base_url=cluster.url, timeout=args.request_timeout, limits=limits) as client:
            await asyncio.gather(*(run_session(client, i, plan, config, outcomes)
                                   for i, plan in enumerate(workload.sessions)))
        metrics = await asyncio.to_thread(scrape_metrics, cluster.url)
    finally:
        await asyncio.to_thread(cluster.close, args.keep_logs)
    result = summarize(config, outcomes, args.workers, args.block_size, metrics)
    print(f"agents {config.name}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


# ------------------------------------------------------------------------------------------------
# The command line.

QUICK = {"sessions": 4, "workers": 2, "min_turns": 3, "max_turns": 4, "time_scale": 0.05, "speedup": 20.0,
         "answer_tokens": (8, 16), "tool_output_tokens": (40, 120)}


def _pair(kind: type) -> Any:
    def parse(text: str) -> tuple[Any, Any]:
        try:
            lo, hi = (kind(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected LO,HI, got {text!r}") from None
        if not 0 <= lo <= hi:
            raise argparse.ArgumentTypeError(f"expected 0 <= LO <= HI, got {text!r}")
        return lo, hi
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)} [default all]")
    p.add_argument("--sessions", type=int, default=16, help="concurrent agent sessions [default 16]")
    p.add_argument("--agent-kinds", type=int, default=4, help="agents (system prompt + tools) the sessions share [default 4]")
    p.add_argument("--min-turns", type=int, default=5, help="[default 5]")
    p.add_argument("--max-turns", type=int, default=20, help="[default 20]")
    p.add_argument("--think", type=_pair(float), default=(0.2, 2.0), help="think time range, seconds [default 0.2,2]")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies every think time [default 1]")
    p.add_argument("--answer-tokens", type=_pair(int), default=(16, 48), help="max_tokens range per turn [default 16,48]")
    p.add_argument("--tool-output-tokens", type=_pair(int), default=(80, 250),
                   help="tool result size range, tokens [default 80,250]")
    p.add_argument("--system-tokens", type=int, default=500, help="an agent's instructions, tokens [default 500]")
    p.add_argument("--notes-tokens", type=int, default=250, help="a session's own system notes, tokens [default 250]")
    p.add_argument("--max-context", type=int, default=7600,
                   help="a session's turns stop before its prompt + answer would pass this (planned, with "
                   "a margin) [default 7600; the tiny model's context is 8192]")
    p.add_argument("--workers", type=int, default=4, help="mocker workers [default 4]")
    p.add_argument("--block-size", type=int, default=16, help="[default 16]")
    p.add_argument("--num-gpu-blocks", type=int, default=768,
                   help="KV blocks per worker [default 768: 12288 tokens, under two sessions' full contexts]")
    p.add_argument("--speedup", type=float, default=1.0, help="mocker --speedup-ratio [default 1]")
    p.add_argument("--worker-args", default="",
                   help="extra flags for every worker, as one argument after '=': --worker-args='--max-num-seqs 8'")
    p.add_argument("--frontend-args", default="",
                   help="extra flags for every configuration's frontend, e.g. "
                   "--frontend-args='--active-decode-blocks-threshold 0.8' (a session leaves a worker past it)")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="seconds a request may wait between bytes before it counts as failed [default 60]")
    p.add_argument("--keep-logs", action="store_true", help="keep each cluster's folder (logs, discovery)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="a few seconds a configuration: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names:
        parser.error(f"unknown configuration(s) {', '.join(unknown) or '(none)'}; valid: {', '.join(CONFIGS)}")
    args.config_names = names
    if args.sessions < 1 or args.workers < 1 or args.agent_kinds < 1:
        parser.error("--sessions, --workers and --agent-kinds must be at least 1")
    if not 1 <= args.min_turns <= args.max_turns:
        parser.error("need 1 <= --min-turns <= --max-turns")
    if args.time_scale < 0 or args.speedup <= 0:
        parser.error("--time-scale must be >= 0 and --speedup > 0")
    return args


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    machine = {"calibration_ns_per_dict_insert_before": calibrate(), "load_average_1m_before": os.getloadavg()[0]}
    workload = await asyncio.to_thread(make_workload, args)
    report: dict[str, Any] = {
        "bench": "agents",
        "settings": {k: getattr(args, k) for k in (
            "sessions", "agent_kinds", "min_turns", "max_turns", "think", "time_scale", "answer_tokens",
            "tool_output_tokens", "system_tokens", "notes_tokens", "max_context", "workers", "block_size",
            "num_gpu_blocks", "speedup", "seed", "quick")},
        "workload": workload.summary(),
        "configs": {},
    }
    for name in args.config_names:
        report["configs"][name] = await run_config(args, CONFIGS[name], workload)
    report["failed"] = sum(c["failed"] for c in report["configs"].values())
    # Shared machines: how fast it ran Python, and how busy it was, around the runs.
    report["machine"] = {**machine, "calibration_ns_per_dict_insert_after": calibrate(),
                         "load_average_1m_after": os.getloadavg()[0]}
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    report = asyncio.run(run(parse_args(argv)))
    print(json.dumps(report, indent=2))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
