"""Child process for the discovery tests: registers keys, then waits to be closed or killed.

    python register.py BACKEND TARGET TTL KEY=VALUE [KEY=VALUE ...]

BACKEND is ``etcd`` (TARGET: endpoints) or ``file`` (TARGET: root dir). A key written ``+KEY=VALUE``
is put without a lease (it must persist). Prints ``READY <lease id hex>`` once every key is put.
A ``close`` line on stdin (or stdin closing) closes the store cleanly and prints ``CLOSED``.
"""

from __future__ import annotations

import asyncio
import sys

from dynamod.shared.discovery.etcd_endpoints import parse_etcd_endpoints
from dynamod.shared.discovery.factory import make_store


async def main(argv: list[str]) -> int:
    backend, target, ttl_text, *pairs = argv
    if backend == "etcd":
        store = make_store("etcd", etcd_endpoints=parse_etcd_endpoints(target))
    else:
        store = make_store(backend, file_root=target)
    await store.start()
    lease = await store.create_lease(float(ttl_text))
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key.startswith("+"):
            await store.put(key[1:], value.encode())
        else:
            await store.put(key, value.encode(), lease)
    print(f"READY {lease.id:x}", flush=True)
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line or line.strip() == "close":
            break
    await store.close()
    print("CLOSED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
