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
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pytest

from dynamod.shared.cluster.pools import read_ready_replicas
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.protocol.keys import planner_status_key
from dynamod.shared.protocol.planner import PlannerStatus
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import free_port
from tests.integration.test_frontend_support import clean_env

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
        "--planner-args", f"--adjustment-interval {INTERVAL_S:g} --scale-up-grace-period 30",
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
        "--planner-args", f"--adjustment-interval {2 * INTERVAL_S:g} --ttft 2000 --itl 300 --load-predictor constant",
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
