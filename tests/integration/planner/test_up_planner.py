"""End to end: ``dynamod up --planner ...`` sizes the cluster to a stepped load (low, high, low): it
grows within a bounded number of planner intervals once the load saturates it, shrinks back after
the load drops, and no request fails on the way, the drained-and-stopped workers' included.

- ``--planner load`` with agg workers (``--min-workers 1 --max-workers 4``);
- ``--planner sla`` with a disaggregated cluster (a prefill and a decode pool, each 1..3), planning
  from a profile that ``dynamod profile`` measured for the same mocker settings.

The mocker is slowed (``--speedup-ratio``) and given little KV cache (``--num-gpu-blocks``) so a
few dozen concurrent requests saturate one worker; the planner decides every second. Phases end on
conditions (the worker count reached), never on a timer; intervals are counted from the planner's
own decision ids in its status record.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pytest

from dynamod.shared.cluster.pools import read_instances, read_ready_replicas
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.protocol.instance import STATUS_READY
from dynamod.shared.protocol.keys import planner_status_key
from dynamod.shared.protocol.planner import PlannerStatus
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import free_port
from tests.integration.frontend.test_frontend_support import clean_env

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

INTERVAL_S = 1.0
LOW, HIGH = 1, 32  # concurrent clients
SCALE_UP_BOUND = 15  # planner intervals from the load step to a second ready worker
SCALE_DOWN_BOUND = 60  # planner intervals from the load drop back to one worker


@dataclass
class LoadStats:
    ok: int = 0
    failed: list[str] = field(default_factory=list)


class SteppedLoad:
    """``concurrency`` clients each sending one completion after another. Lowering it lets the
    surplus clients finish the request they are in: none is abandoned (that would be our failure,
    not the cluster's)."""

    def __init__(self, url: str, *, prompt_words: int = 20, max_tokens: int = 48) -> None:
        self.url = url
        self.prompt_words = prompt_words
        self.max_tokens = max_tokens
        self.stats = LoadStats()
        self._clients: list[tuple[asyncio.Task[None], asyncio.Event]] = []
        self._leaving: list[asyncio.Task[None]] = []
        self._http = httpx.AsyncClient(timeout=120)

    def set_concurrency(self, n: int) -> None:
        while len(self._clients) > n:
            task, stop = self._clients.pop()
            stop.set()
            self._leaving.append(task)
        while len(self._clients) < n:
            stop = asyncio.Event()
            self._clients.append((asyncio.create_task(self._client(len(self._clients), stop)), stop))

    async def _client(self, index: int, stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            await self.one(f"client {index} request {n}")

    async def one(self, tag: object) -> None:
        """One completion, counted ok or failed. The request's own words come first: no two
        prompts share a cached prefix block."""
        body = {"model": "tiny", "prompt": f"{tag} " + "lorem ipsum dolor " * self.prompt_words,
                "max_tokens": self.max_tokens, "ignore_eos": True}
        try:
            resp = await self._http.post(self.url + "/v1/completions", json=body)
            if resp.status_code != 200:
                self.stats.failed.append(f"{resp.status_code}: {resp.text[:200]}")
            elif resp.json()["usage"]["completion_tokens"] != self.max_tokens:
                self.stats.failed.append(f"short completion: {resp.json()['usage']}")
            else:
                self.stats.ok += 1
        except httpx.HTTPError as exc:
            self.stats.failed.append(f"{type(exc).__name__}: {exc}")

    async def close(self) -> None:
        self.set_concurrency(0)
        await asyncio.gather(*self._leaving, return_exceptions=True)
        self._leaving = []
        await self._http.aclose()


class OpenLoad:
    """Requests arriving at a set rate whatever the cluster's pace (open loop, as users arrive):
    what a throughput planner sizes for. A closed loop of N clients would only ever offer what the
    cluster already serves. Every request started is awaited at ``close``: none is abandoned."""

    def __init__(self, url: str, *, prompt_words: int, max_tokens: int) -> None:
        self._client = SteppedLoad(url, prompt_words=prompt_words, max_tokens=max_tokens)
        self.stats = self._client.stats
        self._rate = 0.0
        self._changed = asyncio.Event()
        self._requests: set[asyncio.Task[None]] = set()
        self._pacer = asyncio.create_task(self._pace())

    def set_rate(self, per_s: float) -> None:
        self._rate = per_s
        self._changed.set()

    async def _pace(self) -> None:
        n = 0
        while True:
            if self._rate <= 0:
                self._changed.clear()
                await self._changed.wait()
                continue
            n += 1
            task = asyncio.create_task(self._client.one(n))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 1.0 / self._rate)
            except TimeoutError:
                pass

    async def close(self) -> None:
        self._pacer.cancel()
        await asyncio.gather(self._pacer, return_exceptions=True)
        await asyncio.gather(*self._requests, return_exceptions=True)
        await self._client.close()


async def _status(rt: DistributedRuntime) -> PlannerStatus | None:
    raw = await rt.store.get(planner_status_key("dynamo"))
    return msgspec.json.decode(raw, type=PlannerStatus) if raw else None


async def _until(rt: DistributedRuntime, predicate, timeout: float, what: str, up: subprocess.Popen[str],
                 out: list[str], pool: str | None = "agg"):
    """Polls the ready count of ``pool`` (every pool's, a dict, when None) and the planner status
    until ``predicate(ready, status)``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        counts = await read_ready_replicas(rt.store, "dynamo")
        ready = counts.get(pool, 0) if pool else counts
        status = await _status(rt)
        if status is not None and predicate(ready, status):
            return ready, status
        if up.poll() is not None:
            raise AssertionError(f"dynamod up exited with {up.returncode}:\n{''.join(out)[-4000:]}")
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what} (ready={ready}):\n{''.join(out)[-4000:]}")
        await asyncio.sleep(0.2)


def _stop(up: subprocess.Popen[str]) -> int:
    """Ctrl-C to ``dynamod up`` (unless it already exited); its exit code."""
    if up.poll() is None:
        up.send_signal(signal.SIGINT)
    try:
        return up.wait(90)
    except subprocess.TimeoutExpired:
        up.kill()
        return up.wait(10)


def _start(cmd: list[str], file_kv: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """``dynamod up`` in the background; its output lines collect in the list."""
    up = subprocess.Popen(cmd, env=clean_env(file_kv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(iter(up.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    return up, out


async def test_up_planner_load_follows_a_stepped_load(tmp_path: Path) -> None:
    port = free_port()
    file_kv = tmp_path / "discovery"
    cmd = [
        sys.executable, "-m", "dynamod.daemon.cli", "up", "--http-port", str(port), "--file-kv", str(file_kv),
        "--log-dir", str(tmp_path / "logs"),
        "--planner", "load", "--min-workers", "1", "--max-workers", "4",
        # Workers start in ~2 s here; the scale-down hysteresis is a multiple of the start-up time.
        "--planner-args", f"--adjustment-interval {INTERVAL_S:g} --scale-up-grace-period 30 --worker-startup-time 2",
        "--speedup-ratio", "2", "--num-gpu-blocks", "96", "--block-size", "16", "--max-num-seqs", "8",
        "--worker-args", "--lease-ttl 3",
    ]
    up, out = _start(cmd, file_kv)
    url = f"http://127.0.0.1:{port}"
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(file_kv), event_plane="zmq")
    rt = await DistributedRuntime.create(settings, events=False)
    load = SteppedLoad(url)
    try:
        # Low: one worker, and the planner keeps it so for a few intervals.
        _, status = await _until(rt, lambda r, s: r == 1 and s.last_decision_id >= 1, 120, "the planner", up, out)
        load.set_concurrency(LOW)
        first = status.last_decision_id
        _, status = await _until(rt, lambda r, s: s.last_decision_id >= first + 3, 60, "low intervals", up, out)
        assert (await read_ready_replicas(rt.store, "dynamo"))["agg"] == 1

        # High: more workers within a bounded number of intervals.
        load.set_concurrency(HIGH)
        step_up = status.last_decision_id
        _, status = await _until(rt, lambda r, s: r >= 2, 180, "a second ready worker", up, out)
        up_intervals = status.last_decision_id - step_up
        _, status = await _until(rt, lambda r, s: r >= 3 or s.last_decision_id >= step_up + 40, 120,
                                 "more workers or 40 intervals", up, out)
        peak = (await read_ready_replicas(rt.store, "dynamo"))["agg"]

        # Low again: back to one worker.
        load.set_concurrency(LOW)
        step_down = status.last_decision_id
        _, status = await _until(rt, lambda r, s: r == 1 and s.pools["agg"].desired == 1, 240, "one worker again",
                                 up, out)
        down_intervals = status.last_decision_id - step_down
        await load.close()
        print(f"\nscale-up: 1 -> 2 ready workers in {up_intervals} interval(s); peak {peak}; "
              f"scale-down: back to 1 in {down_intervals} interval(s); requests ok={load.stats.ok} "
              f"failed={len(load.stats.failed)}")
        assert load.stats.failed == [], load.stats.failed[:5]
        assert load.stats.ok > 0
        assert up_intervals <= SCALE_UP_BOUND, up_intervals
        assert down_intervals <= SCALE_DOWN_BOUND, down_intervals
        text = "".join(out)
        assert "restarting it" not in text  # removed workers were retired, not crashed and restarted
    finally:
        await load.close()
        await rt.shutdown(grace_s=0)
        code = _stop(up)
    assert code == 0, "".join(out)[-4000:]


async def test_up_planner_sla_sizes_the_prefill_and_decode_pools(tmp_path: Path) -> None:
    """A disaggregated cluster (one prefill, one decode worker) under ``--planner sla``: `up`
    profiles the slowed mocker its workers run; from that profile and the traffic the frontend
    measures, the planner grows both pools for a high arrival rate, keeps them grown while it
    lasts, and shrinks them back after it."""
    port = free_port()
    file_kv = tmp_path / "discovery"
    cmd = [
        sys.executable, "-m", "dynamod.daemon.cli", "up", "--http-port", str(port), "--file-kv", str(file_kv),
        "--log-dir", str(tmp_path / "logs"), "--router-mode", "kv",
        "--prefill-workers", "1", "--decode-workers", "1",
        "--planner", "sla", "--min-workers", "1", "--max-workers", "3",
        # The constant predictor answers the last interval's traffic: a step shows in one interval.
        "--planner-args", f"--adjustment-interval {2 * INTERVAL_S:g} --ttft 2000 --itl 300 --load-predictor constant "
                          "--worker-startup-time 2",
        "--speedup-ratio", "0.1", "--num-gpu-blocks", "1024", "--block-size", "16", "--max-num-seqs", "16",
        "--worker-args", "--lease-ttl 3",
    ]
    up, out = _start(cmd, file_kv)
    url = f"http://127.0.0.1:{port}"
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(file_kv), event_plane="zmq")
    rt = await DistributedRuntime.create(settings, events=False)
    # ~550-token prompts: one prefill worker of this mocker serves ~4 a second, one decode worker
    # ~58 tokens a second at the ITL target; 8 a second of 16 tokens each needs 2-3 of each.
    load = OpenLoad(url, prompt_words=60, max_tokens=16)
    low_rate, high_rate = 0.5, 8.0

    def both(n: int):  # noqa: ANN202
        return lambda r, s: r["prefill"] == n and r["decode"] == n
    try:
        _, status = await _until(rt, lambda r, s: both(1)(r, s) and s.last_decision_id >= 1, 120, "the planner",
                                 up, out, pool=None)
        assert status.planner == "sla" and status.targets == {"ttft_ms": 2000.0, "itl_ms": 300.0}
        assert (tmp_path / "discovery-planner-profile.json").exists()
        load.set_rate(low_rate)
        first = status.last_decision_id
        _, status = await _until(rt, lambda r, s: s.last_decision_id >= first + 4, 60, "low intervals", up, out,
                                 pool=None)
        assert both(1)(await read_ready_replicas(rt.store, "dynamo"), status), status

        # High: both pools grow, and stay grown while the rate holds.
        load.set_rate(high_rate)
        step_up = status.last_decision_id
        ready, status = await _until(rt, lambda r, s: r["prefill"] >= 2 and r["decode"] >= 2, 240,
                                     "both pools to grow", up, out, pool=None)
        up_intervals = status.last_decision_id - step_up
        held = status.last_decision_id
        desired: dict[int, tuple[int, int]] = {}
        while status.last_decision_id < held + 5:
            desired[status.last_decision_id] = (status.pools["prefill"].desired, status.pools["decode"].desired)
            await asyncio.sleep(0.2)
            status = await _status(rt) or status
        assert min(p for p, _ in desired.values()) >= 2 and min(d for _, d in desired.values()) >= 2, desired

        # Low again: both pools back to one worker.
        load.set_rate(low_rate)
        step_down = status.last_decision_id
        _, status = await _until(
            rt, lambda r, s: both(1)(r, s) and s.pools["prefill"].desired == 1 and s.pools["decode"].desired == 1,
            240, "one worker per pool again", up, out, pool=None)
        down_intervals = status.last_decision_id - step_down
        await load.close()
        print(f"\nsla: both pools >= 2 in {up_intervals} interval(s) (then {ready}, desired held {desired}); "
              f"back to 1+1 in {down_intervals} interval(s); requests ok={load.stats.ok} "
              f"failed={len(load.stats.failed)}")
        assert load.stats.failed == [], load.stats.failed[:5]
        assert load.stats.ok > 0
        assert up_intervals <= SCALE_UP_BOUND, up_intervals
        assert down_intervals <= SCALE_DOWN_BOUND, down_intervals
        assert "restarting it" not in "".join(out)
    finally:
        await load.close()
        await rt.shutdown(grace_s=0)
        code = _stop(up)
    assert code == 0, "".join(out)[-4000:]


# -- issue 22 item 5: queued load on the defaults a new user starts with ------------------------------

LIVE_INTERVAL_S = 1.0
LIVE_CLIENTS = 64  # the 64 streams against max-num-seqs 8: one worker runs 8 and queues 56


@dataclass
class Served:
    """One answered request: when the client sent it and which worker answered (response header)."""

    sent: float  # loop time
    worker: int
    done: float = 0.0


class TaggedLoad(SteppedLoad):
    """``SteppedLoad`` streaming its completions (as the issue's 64 streams did; the frontend
    measures ITL between streamed tokens), recording per successful request its send and end
    times and the worker the frontend names in ``x-dynamo-worker-instance-id``."""

    def __init__(self, url: str, **kw: int) -> None:
        super().__init__(url, **kw)
        self.served: list[Served] = []

    async def one(self, tag: object) -> None:
        body = {"model": "tiny", "prompt": f"{tag} " + "lorem ipsum dolor " * self.prompt_words,
                "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            async with self._http.stream("POST", self.url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    self.stats.failed.append(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
                    return
                worker = int(resp.headers["x-dynamo-worker-instance-id"], 16)
                usage, done = None, False
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[len("data: "):])
                        if "error" in chunk:
                            self.stats.failed.append(f"stream error: {chunk['error']}")
                            return
                        usage = chunk.get("usage") or usage
        except httpx.HTTPError as exc:
            self.stats.failed.append(f"{type(exc).__name__}: {exc}")
            return
        if not done or not usage or usage["completion_tokens"] != self.max_tokens:
            self.stats.failed.append(f"short stream: done={done} usage={usage}")
            return
        self.stats.ok += 1
        self.served.append(Served(sent, worker, loop.time()))


async def _planner_status_cells(file_kv: Path) -> dict[str, str]:
    """``dynamoctl planner status`` run as a user would (its own process, the cluster's discovery):
    the agg pool's row, column -> cell."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dynamod.console.ctl.main", "planner", "status", "--discovery", "file",
        "--file-kv", str(file_kv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(file_kv))
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, stderr.decode()
    lines = stdout.decode().splitlines()
    header = lines[0].split()
    row = next(line for line in lines if line.startswith("dynamo/agg")).split()
    return dict(zip(header, row, strict=False))


def _decisions(log_dir: Path, last: int = 6) -> str:
    """The planner's last decision lines from its log (what it decided, from which figures)."""
    path = log_dir / "planner.log"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join([line for line in lines if "planner decision" in line][-last:]) or "(none logged)"


def routing_after_scale_up(served: list[Served], first: int, new: dict[int, float], until: float) -> dict:
    """Who served the requests sent while the grown pool ran, and how long they took.

    ``first_request_after_ready_s``: per new worker, from its first sighting as ready to the send
    time of the first request it served. ``share_first_interval``: per worker, its share of the
    requests sent in the interval after the first new worker was ready (the first worker's
    backlog is deepest then). ``share_after_scale_up`` and ``latency_s`` (end-to-end p50/p99):
    every request sent from when the last new worker was ready (all have finished: the clients
    were stopped)."""
    joined, settled = min(new.values()), max(new.values())
    workers = [first, *new]

    def share(batch: list[Served]) -> dict[str, float]:
        return {f"{w:x}": round(sum(s.worker == w for s in batch) / max(1, len(batch)), 2) for w in workers}

    latency = sorted(s.done - s.sent for s in served if settled <= s.sent < until)
    return {
        "first_request_after_ready_s": {
            f"{w:x}": round(min((s.sent for s in served if s.worker == w and s.sent >= t), default=float("inf")) - t, 2)
            for w, t in new.items()
        },
        "share_first_interval": share([s for s in served if joined <= s.sent < joined + LIVE_INTERVAL_S]),
        "share_after_scale_up": share([s for s in served if settled <= s.sent < until]),
        "latency_s": {"p50": round(latency[len(latency) // 2], 2), "p99": round(latency[int(len(latency) * 0.99)], 2),
                      "requests": len(latency)} if latency else {},
    }


class ReadyWatch:
    """Polls discovery for the agg pool's ready workers and remembers when each was first seen
    ready (loop time), so a new worker's first request can be timed from its arrival."""

    def __init__(self, rt: DistributedRuntime) -> None:
        self._rt = rt
        self.first_ready: dict[int, float] = {}
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            for inst in await read_instances(self._rt.store, "dynamo"):
                if inst.role == "agg" and inst.status == STATUS_READY and inst.endpoint == "generate":
                    self.first_ready.setdefault(inst.instance_id, loop.time())
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def run_live_scaling(tmp_path: Path, router_mode: str | None = None, *, clients: int = LIVE_CLIENTS,
                           worker_args: str = "--max-num-seqs 8", speedup: float = 1.0) -> dict:
    """``dynamod up --planner load --min-workers 1 --max-workers 3 --worker-args "--max-num-seqs 8"``
    (``--router-mode`` as given, else `up`'s default) under 64 concurrent clients, then idle.
    Returns what happened; raises AssertionError (with `up`'s output) when a phase times out.
    The keywords let the same run be measured on heavier settings (the note on the router mode)."""
    port = free_port()
    file_kv = tmp_path / "discovery"
    cmd = [
        sys.executable, "-m", "dynamod.daemon.cli", "up", "--http-port", str(port), "--file-kv", str(file_kv),
        "--log-dir", str(tmp_path / "logs"),
        "--planner", "load", "--min-workers", "1", "--max-workers", "3",
        # A mocker worker is ready in ~2 s here: the scale-down hysteresis is a multiple of that.
        "--planner-args", f"--adjustment-interval {LIVE_INTERVAL_S:g} --worker-startup-time 2",
        "--worker-args", f"{worker_args} --lease-ttl 3",
        "--speedup-ratio", f"{speedup:g}", "--shutdown-grace", "10",
        *(["--router-mode", router_mode] if router_mode else []),
    ]
    up, out = _start(cmd, file_kv)
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(file_kv), event_plane="zmq")
    rt = await DistributedRuntime.create(settings, events=False)
    load = TaggedLoad(f"http://127.0.0.1:{port}", prompt_words=20, max_tokens=32)
    watch = ReadyWatch(rt)
    loop = asyncio.get_running_loop()
    result: dict = {"router_mode": router_mode or "default"}
    try:
        _, status = await _until(rt, lambda r, s: r == 1 and s.last_decision_id >= 1, 60, "the planner", up, out)
        (first,) = watch.first_ready
        load.set_concurrency(clients)
        loaded_at, step_up = loop.time(), status.last_decision_id
        try:
            _, status = await _until(rt, lambda r, s: r >= 2, 30, "a second ready worker under queued load", up, out)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nthe planner's last decisions:\n{_decisions(tmp_path / 'logs')}") from None
        result["scale_up_s"] = round(loop.time() - loaded_at, 1)
        result["scale_up_intervals"] = status.last_decision_id - step_up
        # Let the pool finish growing (the third worker, or five intervals without one) and serve
        # four more intervals, then stop the clients (each finishes the request it is in) and look
        # at every request sent meanwhile, the slow ones included.
        held = status.last_decision_id
        _, status = await _until(rt, lambda r, s: r >= 3 or s.last_decision_id >= held + 5, 30, "the pool grown",
                                 up, out)
        held = status.last_decision_id
        _, status = await _until(rt, lambda r, s: s.last_decision_id >= held + 4, 30, "four more intervals", up, out)
        grown_until = loop.time()
        result["dynamoctl_under_load"] = await _planner_status_cells(file_kv)
        result["peak_ready"] = max((await read_ready_replicas(rt.store, "dynamo")).get("agg", 0),
                                   len(watch.first_ready))
        load.set_concurrency(0)  # idle from here on
        await asyncio.gather(*load._leaving, return_exceptions=True)
        new = {w: t for w, t in watch.first_ready.items() if w != first}
        result.update(routing_after_scale_up(load.served, first, new, grown_until))
        idle_at, step_down = loop.time(), status.last_decision_id
        try:
            _, status = await _until(rt, lambda r, s: r == 1 and s.pools["agg"].desired == 1, 40, "one worker again",
                                     up, out)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nso far: {result}\nthe planner's last decisions:\n"
                                 f"{_decisions(tmp_path / 'logs')}") from None
        result["scale_down_s"] = round(loop.time() - idle_at, 1)
        result["scale_down_intervals"] = status.last_decision_id - step_down
        result["ok"], result["failed"] = load.stats.ok, list(load.stats.failed)
        result["restarted"] = "restarting it" in "".join(out)
        return result
    finally:
        await watch.close()
        await load.close()
        await rt.shutdown(grace_s=0)
        result["exit_code"] = _stop(up)
        result["output_tail"] = "".join(out)[-3000:]


@pytest.mark.timeout(150)
async def test_up_planner_load_scales_for_queued_requests_and_new_workers_take_them(tmp_path: Path) -> None:
    """Issue 22 item 5, as a new user would run it: only ``--max-num-seqs`` is small (the KV cache
    is the default, so KV usage stays low and the backlog is queued requests), 64 clients. The
    planner scales up; each new worker gets its first request within one planner interval of
    becoming ready; in that first interval the new requests go to the new workers rather than
    behind the first worker's backlog (the KV router `up` picks with a planner: round-robin would
    give it half of them with two ready); once idle the pool returns to one worker; no request fails."""
    r = await run_live_scaling(tmp_path)
    print(f"\nlive scaling: {json.dumps({k: v for k, v in r.items() if k != 'output_tail'})}")
    assert r["router_mode"] == "default"
    assert r["failed"] == [], r["failed"][:5]
    assert r["ok"] > 0
    assert r["peak_ready"] >= 2
    for worker, delay in r["first_request_after_ready_s"].items():
        assert delay <= LIVE_INTERVAL_S, (worker, delay, r)
    first, *new = r["share_first_interval"]
    # Round-robin hands the backlogged first worker half of them with two workers ready.
    assert r["share_first_interval"][first] < 0.25, r["share_first_interval"]
    assert all(r["share_after_scale_up"][w] >= 0.5 / r["peak_ready"] for w in new), r["share_after_scale_up"]
    # dynamoctl shows the live figures (issue 24 item 14): the planner measured them.
    cells = r["dynamoctl_under_load"]
    assert all(not cells[c].startswith("-") for c in ("REQ/S", "ISL", "OSL", "TTFT", "ITL")), cells
    assert not r["restarted"]
    assert r["exit_code"] == 0, r["output_tail"]
