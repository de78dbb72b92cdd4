"""The operator actions, declared once: the TUI binds keys and palette entries from this registry,
and ``dynamoctl`` maps its subcommands onto the same specs (worker actions) or the same override
keys (pool actions, ``scaling.py``).

A worker action names its control endpoint and the body type that endpoint takes
(``shared/protocol/control.py``); ``ControlClient.run(spec, target, body)`` runs any of them, so
neither the console nor ``dynamoctl`` needs a branch per action.

One meaning per key across every view (``check_unique_keys``): ``s`` is Sleep wherever a worker is
selected, so scaling a pool is ``r`` (replicas), not a second ``s`` that meant Scale in one view.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamod.shared.protocol import control


@dataclass(frozen=True, slots=True)
class ActionSpec:
    name: str  # method suffix in the TUI (action_<name>)
    verb: str  # the dynamoctl command (``clear-kv``, ``lora load``) and the label of its result
    endpoint: str  # worker control endpoint it calls
    body: type[control.ControlBody]  # what that endpoint takes
    title: str  # shown in the palette, the help and the notifications
    help: str
    key: str = ""  # single key, k9s style; "" for a dynamoctl-only action (not bound in the TUI)
    short: str = ""  # footer label: six actions must fit an 80-column footer
    removes_capacity: bool = False  # asks for confirmation first


ACTIONS: tuple[ActionSpec, ...] = (
    ActionSpec("drain", "drain", control.DRAIN, control.DrainRequest, "Drain", "stop sending new requests to the worker; in-flight ones finish", "d", "Drain", True),
    ActionSpec("sleep", "sleep", control.SLEEP, control.SleepRequest, "Sleep", "release the engine's memory (level 1 keeps weights on host, 2 drops them)", "s", "Sleep", True),
    ActionSpec("wake", "wake", control.WAKE_UP, control.EmptyRequest, "Wake", "wake a sleeping (or drained) worker so it takes requests again", "w", "Wake", False),
    ActionSpec("load_lora", "lora load", control.LOAD_LORA, control.LoadLoraRequest, "Load LoRA", "load a LoRA adapter by name from a path or URI", "l", "+LoRA", False),
    ActionSpec("unload_lora", "lora unload", control.UNLOAD_LORA, control.UnloadLoraRequest, "Unload LoRA", "unload a LoRA adapter; requests for it fail afterwards", "u", "-LoRA", True),
    ActionSpec("clear_kv", "clear-kv", control.CLEAR_KV_BLOCKS, control.ClearKvRequest, "Clear KV", "drop the worker's cached KV blocks (prefix hits restart from zero)", "c", "ClearKV", True),
)
# Read-only, so no key: ``dynamoctl lora list`` (the console shows adapters from discovery).
LIST_LORAS = ActionSpec("list_loras", "lora list", control.LIST_LORAS, control.EmptyRequest, "List LoRAs",
                        "the LoRA adapters loaded on the worker")
ACTIONS_BY_NAME = {a.name: a for a in ACTIONS}
ACTIONS_BY_VERB = {a.verb: a for a in (*ACTIONS, LIST_LORAS)}


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
