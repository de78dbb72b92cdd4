"""LoRA adapter sources and names against a real worker process (issue 25, items 1 and 7).

One mocker worker with ``--lora-root``: sources outside the root (absolute, ``..``, a symlink out,
``/proc``), remote schemes not allowed and names with escape sequences are each refused with one
line, nothing of them reaches the model cards or the intent, and an intent holding such a source
(written before the restart, as an older version would have) is dropped when the worker starts.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.protocol.intent import WorkerIntent, decode_intent, encode_intent
from dynamod.shared.protocol.keys import intent_key, mdc_key
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.daemons import DaemonProcess, file_cluster_env
from tests.fixtures.lora import make_adapter

pytestmark = pytest.mark.timeout(90)


async def _control(comp, name: str, inst_id: int, body: dict) -> dict:
    client = await comp.endpoint(name).client()
    try:
        await client.wait_for_instances(1, timeout=20, routable=False)
        return (await client.call(body, instance_id=inst_id))[-1]
    finally:
        await client.close()


async def test_lora_sources_outside_the_root_are_refused_and_dropped_from_intent(tmp_path: Path) -> None:
    kv_dir, root, outside = tmp_path / "kv", tmp_path / "adapters", tmp_path / "outside"
    good = make_adapter(root, "good").resolve()
    evil = make_adapter(outside, "evil")
    (root / "link").symlink_to(evil, target_is_directory=True)  # a symlink out of the root
    (root / "plain").mkdir()  # inside, but no adapter_config.json
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(kv_dir), event_plane="zmq", lease_ttl_s=3.0)
    rt = await DistributedRuntime.create(settings)
    # What an unpatched worker would have recorded: re-applied on restart unless checked again.
    await rt.store.put(
        intent_key("dynamo", "backend", "w0"),
        encode_intent(WorkerIntent(loras={"good": str(good), "etc": "/etc", "env": "/proc/self/environ"})),
    )
    env = file_cluster_env(kv_dir, DYN_LEASE_TTL="3", DYN_LORA_ROOT=str(root))
    worker = DaemonProcess(["--role", "agg", "--engine", "mocker", "--model", "tiny", "--speedup-ratio", "50",
                            "--worker-name", "w0"], env=env, log_dir=str(tmp_path))
    try:
        comp = rt.namespace().component("backend")
        client = await comp.endpoint("generate").client()
        await client.wait_for_instances(1, timeout=30)
        [inst] = client.instances
        await client.close()
        wid = inst.instance_id
        listed = await _control(comp, "list_loras", wid, {})
        assert [lo["name"] for lo in listed["loras"]] == ["good"], worker.log()
        stored = decode_intent(await rt.store.get(intent_key("dynamo", "backend", "w0")))
        assert stored.loras == {"good": str(good)}

        refused = {
            "/etc": "not inside",
            str(root / ".." / "outside" / "evil"): "not inside",
            str(root / "link"): "not inside",
            "file:///proc/self/environ": "not inside",
            str(root / "plain"): "no adapter_config.json",
            "s3://bucket/evil": "remote s3:// sources are not allowed",
            "hf://org/evil": "remote hf:// sources are not allowed",
        }
        for source, why in refused.items():
            with pytest.raises(Exception, match=why):
                await _control(comp, "load_lora", wid, {"lora_name": "x1", "source": source})
        for name in ("\x1b[2J\x1b]0;pwned\x07", "a/b", "", "x" * 200, "név"):
            with pytest.raises(Exception, match="lora_name .* is not valid"):
                await _control(comp, "load_lora", wid, {"lora_name": name, "source": str(good)})
        listed = await _control(comp, "list_loras", wid, {})
        assert [lo["name"] for lo in listed["loras"]] == ["good"]
        assert await rt.store.get(mdc_key("dynamo", "backend", "generate", wid, "x1")) is None
        assert decode_intent(await rt.store.get(intent_key("dynamo", "backend", "w0"))).loras == {"good": str(good)}

        # dynamoctl tells the operator in one line, exit 1.
        res = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(kv_dir), "lora", "load", f"{wid:x}",
             "evil", str(root / "link")],
            capture_output=True, text=True, timeout=60, env={**os.environ},
        )
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert res.returncode == 1 and len(lines) == 1 and "not inside an adapter directory" in lines[0], res
        assert "intent lora dropped" in worker.log()
    finally:
        worker.kill()
        await rt.shutdown(0)


def test_a_worker_without_lora_root_loads_nothing(tmp_path: Path) -> None:
    from dynamod.daemon.worker.lora_policy import LoraSourcePolicy
    from dynamod.shared.errors import InvalidRequestError

    make_adapter(tmp_path, "a")
    with pytest.raises(InvalidRequestError, match="--lora-root"):
        LoraSourcePolicy().check(str(tmp_path / "a"))
    assert LoraSourcePolicy.create([str(tmp_path)]).check(str(tmp_path / "a")) == str((tmp_path / "a").resolve())
