"""The operator actions, declared once: the TUI binds keys and palette entries from this registry,
and ``dynamoctl`` maps its subcommands onto the same control endpoints (worker actions) or the same
override keys (pool actions, ``scaling.py``).

One meaning per key across every view (``check_unique_keys``): ``s`` is Sleep wherever a worker is
selected, so scaling a pool is ``r`` (replicas), not a second ``s`` that meant Scale in one view.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamod.shared.protocol import control


@dataclass(frozen=True, slots=True)
class ActionSpec:
    name: str  # method suffix in the TUI (action_<name>) and dynamoctl verb
    key: str  # single key, k9s style
    title: str  # shown in the palette, the help and the notifications
    short: str  # footer label: six actions must fit an 80-column footer
    endpoint: str  # worker control endpoint it calls
    removes_capacity: bool  # asks for confirmation first
    help: str


ACTIONS: tuple[ActionSpec, ...] = (
    ActionSpec("drain", "d", "Drain", "Drain", control.DRAIN, True, "stop sending new requests to the worker; in-flight ones finish"),
    ActionSpec("sleep", "s", "Sleep", "Sleep", control.SLEEP, True, "release the engine's memory (level 1 keeps weights on host, 2 drops them)"),
    ActionSpec("wake", "w", "Wake", "Wake", control.WAKE_UP, False, "wake a sleeping (or drained) worker so it takes requests again"),
    ActionSpec("load_lora", "l", "Load LoRA", "+LoRA", control.LOAD_LORA, False, "load a LoRA adapter by name from a path or URI"),
    ActionSpec("unload_lora", "u", "Unload LoRA", "-LoRA", control.UNLOAD_LORA, True, "unload a LoRA adapter; requests for it fail afterwards"),
    ActionSpec("clear_kv", "c", "Clear KV", "ClearKV", control.CLEAR_KV_BLOCKS, True, "drop the worker's cached KV blocks (prefix hits restart from zero)"),
)
ACTIONS_BY_NAME = {a.name: a for a in ACTIONS}


@dataclass(frozen=True, slots=True)
class PoolActionSpec:
    """An action on a pool (namespace x pool) rather than a worker: bound in the Scaling view."""

    name: str
    key: str
    title: str
    short: str
    help: str


POOL_ACTIONS: tuple[PoolActionSpec, ...] = (
    PoolActionSpec("scale", "r", "Scale pool", "Replicas",
                   "hold the pool at N replicas (an override the planner respects; asks to confirm when it lowers capacity)"),
    PoolActionSpec("clear_override", "x", "Clear override", "Clear",
                   "delete the pool's override: the planner sizes it again (asks to confirm)"),
)
POOL_ACTIONS_BY_NAME = {a.name: a for a in POOL_ACTIONS}

# Keys the app binds for navigation (``console/tui/app.py``): no action may take one of them.
NAVIGATION_KEYS = frozenset({"colon", "slash", "question_mark", "escape", "enter", "q", *map(str, range(1, 10))})


def check_unique_keys() -> None:
    """Raises if two actions (worker or pool) share a key, or one takes a navigation key."""
    seen: dict[str, str] = {}
    for name, key in [(a.name, a.key) for a in ACTIONS] + [(p.name, p.key) for p in POOL_ACTIONS]:
        if key in seen or key in NAVIGATION_KEYS:
            raise ValueError(f"key {key!r} of action {name} is already {seen.get(key, 'a navigation key')}")
        seen[key] = name


check_unique_keys()
