"""Choosing a transfer backend by name."""

from __future__ import annotations

import logging

import pytest

from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.transfer import factory
from dynamod.shared.kv.transfer.factory import create_agent, nixl_available, nixl_unavailable_reason
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.nixl import NixlKvAgent
from dynamod.shared.kv.transfer.tcp import TcpKvAgent
from dynamod.shared.protocol.kv_transfer import KvLayout


def test_unknown_backend_is_a_config_error_listing_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="unknown KV transfer backend 'rdma'; valid: auto, nixl, tcp"):
        create_agent(KvBlockMemory(1, 64), worker_id=1, backend="rdma")


async def test_tcp_is_chosen_by_name_and_carries_the_layout() -> None:
    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype_bytes=2, block_size=4)
    agent = create_agent(KvBlockMemory(2, layout.block_bytes), worker_id=0x2A, backend="TCP", layout=layout)
    assert isinstance(agent, TcpKvAgent)
    await agent.start()
    try:
        meta = agent.metadata()
        assert meta.layout == layout and meta.backend == "tcp" and meta.agent_name.startswith("2a-")
    finally:
        await agent.close()


def test_auto_uses_nixl_exactly_when_it_is_usable(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=factory.__name__):
        agent = create_agent(KvBlockMemory(1, 64), worker_id=1)
    expected = NixlKvAgent if nixl_available() else TcpKvAgent
    assert isinstance(agent, expected)
    assert f"backend={agent.backend} requested=auto" in caplog.text


def test_auto_falls_back_to_tcp_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(factory, "nixl_unavailable_reason", lambda: "NIXL is not installed")
    with caplog.at_level(logging.INFO, logger=factory.__name__):
        agent = create_agent(KvBlockMemory(1, 64), worker_id=1, backend="auto")
    assert isinstance(agent, TcpKvAgent)
    assert "backend=tcp requested=auto reason='NIXL is not installed'" in caplog.text
    with pytest.raises(ConfigError, match="'nixl' is not usable here: NIXL is not installed"):
        create_agent(KvBlockMemory(1, 64), worker_id=1, backend="nixl")


def test_nixl_reason_is_none_when_the_module_imports() -> None:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        pytest.skip("nixl-cu12 is not installed")
    assert nixl_unavailable_reason() is None
