"""Support for the outage tests (no tests here): a cluster on real etcd and NATS, and a streaming
load that records every request's fate, so a test can prove none was lost or cut short."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.fixtures.servers import EtcdServer, NatsServer
from tests.integration.frontend.test_frontend_support import LocalCluster


class ServerCluster(LocalCluster):
    """``LocalCluster`` on etcd discovery and the NATS event plane instead of files and ZMQ."""

    def __init__(self, root: Path, etcd: EtcdServer, nats: NatsServer, **kwargs: float) -> None:
        super().__init__(root, **kwargs)
        self.etcd = etcd
        self.nats = nats

    def runtime_flags(self) -> list[str]:
        return ["--discovery-backend", "etcd", "--etcd-endpoints", self.etcd.endpoint,
                "--event-plane", "nats", "--nats-server", self.nats.url, "--lease-ttl", str(self.lease_ttl)]


@dataclass
class Outcome:
    started: float  # time.monotonic()
    ended: float
    ok: bool  # [DONE] seen, finish_reason "length", completion_tokens == wanted
    tokens: int
    wanted: int
    worker: str = ""
    error: str = ""


class StreamLoad:
    """``concurrency`` threads sending streaming chat completions back to back until stopped.

    Every request asks for exactly ``max_tokens`` (``ignore_eos``), so a stream that ends early
    is visible: it counts as ``ok`` only with ``[DONE]``, ``finish_reason == "length"`` and the
    usage's ``completion_tokens`` equal to what was asked."""

    def __init__(self, url: str, *, concurrency: int = 4, max_tokens: int = 24, model: str = "tiny",
                 timeout_s: float = 60.0, keepalive: bool = True) -> None:
        """``keepalive=False``: a new connection per request, for a test that must tell which
        process a request reached by when it started (a pooled connection to a process killed
        since stays bound to it, so a request sent on it after the kill fails as one in flight)."""
        self.url = url
        self.keepalive = keepalive
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.model = model
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> StreamLoad:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._run, args=(i,), name=f"load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)
        self._threads.clear()
        return self.outcomes

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def wait_for(self, ok: int, since: float, timeout: float) -> None:
        """Until ``ok`` requests that started after ``since`` have completed in full."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for o in self.snapshot() if o.ok and o.started >= since) >= ok:
                return
            time.sleep(0.05)
        raise AssertionError(f"fewer than {ok} complete requests since t={since:.1f}: {self.summary()}")

    def summary(self) -> str:
        outs = self.snapshot()
        bad = [o for o in outs if not o.ok]
        return f"{len(outs)} requests, {len(bad)} failed: " + "; ".join(sorted({o.error for o in bad})[:5])

    def _run(self, index: int) -> None:
        limits = httpx.Limits() if self.keepalive else httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=self.timeout_s, limits=limits) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                outcome = self.one(client, f"load {index} request {n}: tell me about topic {n % 7}")
                with self._lock:
                    self.outcomes.append(outcome)

    def one(self, client: httpx.Client, prompt: str) -> Outcome:
        body = {"model": self.model, "stream": True, "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": prompt}]}
        started = time.monotonic()
        tokens, finish, done, worker = 0, None, False, ""
        try:
            with client.stream("POST", self.url + "/v1/chat/completions", json=body) as resp:
                worker = resp.headers.get("x-dynamo-worker-instance-id", "")
                if resp.status_code != 200:
                    resp.read()
                    return Outcome(started, time.monotonic(), False, 0, self.max_tokens, worker,
                                   f"HTTP {resp.status_code}: {resp.text[:200]}")
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return Outcome(started, time.monotonic(), False, tokens, self.max_tokens, worker,
                                       f"error chunk: {chunk['error']}")
                    for choice in chunk.get("choices", []):
                        finish = choice.get("finish_reason") or finish
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
        except httpx.HTTPError as exc:
            return Outcome(started, time.monotonic(), False, tokens, self.max_tokens, worker, f"{type(exc).__name__}: {exc}")
        ok = done and finish == "length" and tokens == self.max_tokens
        error = "" if ok else f"truncated: done={done} finish={finish} tokens={tokens}/{self.max_tokens}"
        return Outcome(started, time.monotonic(), ok, tokens, self.max_tokens, worker, error)
