"""What each worker action asks the operator before it runs, as the body its endpoint takes.

The TUI's keys all go one way (``ConsoleApp.start_action``): ``ask_body`` gives the action's body at
once (drain, wake, clear KV), a ``Question`` whose answer becomes the body (sleep level, LoRA name
and source, which adapter to unload), or a one-line reason the action cannot be asked for now. An
action that removes capacity is then confirmed with its ``CONFIRM_TEXT`` filled from the body, and
sent through ``ControlClient.run``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from textual.screen import Screen

from dynamod.console.actions.specs import ActionSpec
from dynamod.console.state.records import Worker
from dynamod.console.tui.screens import LoraLoadScreen, LoraUnloadScreen, SleepLevelScreen
from dynamod.shared.protocol import control
from dynamod.shared.security.printable import printable

# Filled with ``t`` (the worker id), ``m`` (" (model)" or "") and the body's fields.
CONFIRM_TEXT = {
    "drain": "Drain worker {t}{m}? It stops taking new requests; in-flight requests finish.",
    "sleep": "Put worker {t}{m} to sleep at level {level}? It stops serving until woken.",
    "unload_lora": "Unload LoRA {lora_name} from worker {t}? Requests for it will fail there.",
    "clear_kv": "Clear the KV cache of worker {t}{m}? Cached prefixes are lost.",
}


@dataclass(frozen=True, slots=True)
class Question:
    """A screen to ask on; a truthy answer becomes the body (a falsy one cancels)."""

    screen: Screen[Any]
    to_body: Callable[[Any], control.ControlBody]


Asked = control.ControlBody | Question | str  # str: why the action cannot run now (a warning)


def _unload(target: str, worker: Worker | None) -> Asked:
    loras = sorted(worker.loras) if worker is not None else []
    if not loras:
        return f"no LoRA adapter is loaded on {target}"
    return Question(LoraUnloadScreen(target, loras), lambda lora: control.UnloadLoraRequest(lora_name=lora))


# The console drains without waiting: the reply comes at once and the worker shows ``draining``.
ASKS: dict[str, Callable[[str, Worker | None], Asked]] = {
    "drain": lambda target, worker: control.DrainRequest(wait=False),
    "sleep": lambda target, worker: Question(SleepLevelScreen(target), lambda level: control.SleepRequest(level=level)),
    "wake": lambda target, worker: control.EmptyRequest(),
    "load_lora": lambda target, worker: Question(
        LoraLoadScreen(target),
        lambda answer: control.LoadLoraRequest(lora_name=answer[0], source=control.LoraSource(uri=answer[1])),
    ),
    "unload_lora": _unload,
    "clear_kv": lambda target, worker: control.ClearKvRequest(),
}


def ask_body(spec: ActionSpec, target: str, worker: Worker | None) -> Asked:
    return ASKS[spec.name](target, worker)


def confirm_text(spec: ActionSpec, target: str, model: str, body: control.ControlBody) -> str:
    """The question before an action that removes capacity. Names the worker and model shown as
    text (``printable``): an adapter name comes from the cluster."""
    fields = {k: printable(v) if isinstance(v, str) else v for k, v in msgspec.structs.asdict(body).items()}
    return CONFIRM_TEXT[spec.name].format(t=target, m=model, **fields)
