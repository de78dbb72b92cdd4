"""The shared port picker: below the ephemeral range, bindable, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from dynamod.shared.transport import ports


class _Scripted:
    """Stands in for the picker's random source: hands out the given ports in order."""

    def __init__(self, *values: int) -> None:
        self.values = list(values)

    def randrange(self, lo: int, hi: int) -> int:
        value = self.values.pop(0)
        assert lo <= value < hi
        return value


def test_ports_lie_below_the_ephemeral_range_and_are_never_repeated() -> None:
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == 50
    assert all(ports.LOWEST <= p < ports.EPHEMERAL_LOW for p in picked)
    base = ports.free_port_run(4)
    assert not {base, base + 1, base + 2, base + 3} & set(picked)
    for p in range(base, base + 4):  # the whole run binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_or_handed_out_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        monkeypatch.setattr(ports, "EPHEMERAL_LOW", max(ports.EPHEMERAL_LOW, min(busy + 100, 65536)))
        given = ports.free_port()
        free = next(p for p in range(busy + 1, min(busy + 100, 65536))
                    if p not in ports._handed_out and ports._bindable("127.0.0.1", p))
        monkeypatch.setattr(ports, "_pick", _Scripted(busy, given, free))
        assert ports.free_port() == free


def test_a_range_without_room_below_falls_back_to_the_kernels_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_LOW", ports.LOWEST + 100)
    a, b = ports.free_port(), ports.free_port()
    assert a != b and a > 0 and b > 0
    with pytest.raises(ValueError, match="at least 1"):
        ports.free_port_run(0)
