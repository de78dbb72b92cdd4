"""A publisher process driven over stdin/stdout with one JSON object per line.

Run by the event plane integration tests so that delivery is checked between two processes, as it
happens in a cluster (a worker publishing, a router subscribing). Commands:

- ``{"cmd": "open", "ns", "component", "topic"}`` creates (or reuses) a publisher and answers with
  the discovery entries this process registered (``channels``: key -> value) for the ZMQ plane.
- ``{"cmd": "pub", "ns", "component", "topic", "count", "prefix"}`` publishes ``count`` messages
  with payloads ``{prefix}-{i}`` and answers once they were handed to the transport.
- ``{"cmd": "close", "ns", "component", "topic"}`` closes that publisher.
- ``{"cmd": "exit"}`` closes everything and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.events.factory import make_event_plane
from dynamod.shared.events.plane import EventPlane, EventPublisher
from dynamod.shared.protocol.keys import EVENT_CHANNELS_ROOT


def _make_store(args: argparse.Namespace) -> DiscoveryStore:
    if args.discovery == "file":
        from dynamod.shared.discovery.file import FileStore  # type: ignore[import-not-found]

        return FileStore(args.file_kv)
    if args.discovery == "etcd":
        from dynamod.shared.discovery.etcd import EtcdStore

        return EtcdStore([args.etcd])
    from dynamod.shared.discovery.mem import MemStore

    return MemStore()


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plane", choices=("nats", "zmq"), required=True)
    parser.add_argument("--url", help="NATS URL")
    parser.add_argument("--discovery", choices=("file", "etcd", "mem"), default="mem")
    parser.add_argument("--file-kv")
    parser.add_argument("--etcd")
    args = parser.parse_args()

    store: DiscoveryStore | None = None
    plane: EventPlane
    instance_id = 0
    if args.plane == "zmq":
        store = _make_store(args)
        await store.start()
        lease = await store.create_lease(10.0)
        instance_id = lease.id
        plane = make_event_plane("zmq", store=store, lease=lease)
    else:
        plane = make_event_plane("nats", nats_url=args.url)
    await plane.start()
    publishers: dict[tuple[str, str, str], EventPublisher] = {}
    _reply({"ready": True, "pid": os.getpid(), "instance_id": instance_id})

    async def get_pub(cmd: dict[str, Any]) -> EventPublisher:
        scope = (cmd["ns"], cmd["component"], cmd["topic"])
        if scope not in publishers:
            publishers[scope] = await plane.publisher(*scope)
        return publishers[scope]

    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return 0
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                return 0
            if cmd["cmd"] == "open":
                await get_pub(cmd)
                channels = {}
                if store is not None:
                    raw = await store.get_prefix(EVENT_CHANNELS_ROOT)
                    channels = {k: v.decode() for k, v in raw.items()}
                _reply({"ok": True, "channels": channels})
            elif cmd["cmd"] == "pub":
                pub = await get_pub(cmd)
                for i in range(int(cmd["count"])):
                    await pub.publish(cmd["topic"], f"{cmd['prefix']}-{i}".encode())
                flush = getattr(pub, "flush", None)
                if flush is not None:
                    await flush()
                _reply({"ok": True, "sent": int(cmd["count"])})
            elif cmd["cmd"] == "close":
                pub = publishers.pop((cmd["ns"], cmd["component"], cmd["topic"]))
                await pub.close()
                _reply({"ok": True})
            else:
                _reply({"ok": False, "error": f"unknown command {cmd['cmd']!r}"})
    finally:
        for pub in publishers.values():
            await pub.close()
        await plane.close()
        if store is not None:
            await store.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
