"""``dynamod up``'s pass-through flags (``--worker-args``, ``--frontend-args``, ...): reading them
as a person means them, and refusing the flags ``up`` sets itself.

Two traps live here:

- argparse takes a word that starts with ``-`` and holds no space for a flag, so
  ``--frontend-args "--router-conditional-disagg"`` failed with "expected one argument".
  ``join_passthrough_values`` glues the word after a pass-through flag to it
  (``--frontend-args=--router-conditional-disagg``) before argparse sees the line: the word after
  ``--frontend-args`` is always its value, which is what its ``--help`` says.
- A pass-through flag that ``up`` also sets overrides it in the child (argparse keeps the last
  value): ``--worker-args "--system-port 0"`` moved every worker's status server away from the port
  the supervisor probes, so it killed each worker as hung every 30 s. ``check_owned`` refuses such a
  flag with one line naming the ``up`` flag that sets it, before any child starts.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from dynamod.shared.errors import ConfigError

WORKER_ARGS, PREFILL_ARGS, DECODE_ARGS = "--worker-args", "--prefill-args", "--decode-args"
FRONTEND_ARGS, PLANNER_ARGS = "--frontend-args", "--planner-args"
PASSTHROUGH_FLAGS = (WORKER_ARGS, PREFILL_ARGS, DECODE_ARGS, FRONTEND_ARGS, PLANNER_ARGS)

# Runtime flags every child gets from `up`: they are what makes the children one cluster.
_RUNTIME: dict[str, str] = {
    "--role": "each child's role is set by `dynamod up`",
    "--discovery-backend": "`dynamod up` runs file discovery (see --file-kv)",
    "--event-plane": "`dynamod up` runs the ZMQ event plane",
    "--file-kv": "use `dynamod up --file-kv`",
    "--namespace": "use `dynamod up --namespace`",
}
_WORKER: dict[str, str] = {
    **_RUNTIME,
    "--engine": "use `dynamod up --engine`",
    "--model": "use `dynamod up --model`",
    "--worker-name": "`dynamod up` names each worker (worker-0, prefill-0, ...) so its intent follows it",
    "--system-port": "`dynamod up` gives each worker its own status port and probes it there",
}
OWNED: dict[str, dict[str, str]] = {
    WORKER_ARGS: _WORKER,
    PREFILL_ARGS: _WORKER,
    DECODE_ARGS: _WORKER,
    FRONTEND_ARGS: {
        **_RUNTIME,
        "--http-host": "use `dynamod up --http-host`",
        "--http-port": "use `dynamod up --http-port`",
        "--router-mode": "use `dynamod up --router-mode`",
        "--num-frontends": "use `dynamod up --num-frontends`",
        "--reuse-port": "`dynamod up --num-frontends N` sets it",
    },
    PLANNER_ARGS: {
        **_RUNTIME,
        "--connector": "the planner of `dynamod up` scales this cluster through the local connector",
        "--planner": "use `dynamod up --planner`",
        "--mode": "`dynamod up` sets it from its pools (agg, or prefill + decode)",
        "--min-workers": "use `dynamod up --min-workers`",
        "--max-workers": "use `dynamod up --max-workers`",
    },
}


def join_passthrough_values(argv: Sequence[str]) -> list[str]:
    """``[..., "--frontend-args", "--x"]`` -> ``[..., "--frontend-args=--x"]``: the word after a
    pass-through flag is its value even when it starts with ``-``. A flag given last (no value)
    is left for argparse to report."""
    out: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        if word in PASSTHROUGH_FLAGS and i + 1 < len(words):
            out.append(f"{word}={words[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def flag_names(words: Sequence[str]) -> list[str]:
    """The flags in a split command line, ``--flag=value`` as ``--flag``."""
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def flag_value(words: Sequence[str], flag: str) -> str | None:
    """The last value given to ``flag`` (``--flag V`` or ``--flag=V``) in ``words``, as argparse
    would keep it; None when absent."""
    value = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def split_passthrough(values: Mapping[str, str]) -> dict[str, list[str]]:
    """pass-through flag -> its value split as a shell would; a quote left open is one ConfigError."""
    out = {}
    for flag, text in values.items():
        try:
            out[flag] = shlex.split(text)
        except ValueError as exc:
            raise ConfigError(f"{flag}: {exc} in {text!r}") from None
    return out


def check_owned(values: Mapping[str, str]) -> None:
    """ConfigError naming the first pass-through flag that ``up`` sets itself, and what to do."""
    for flag, words in split_passthrough(values).items():
        owned = OWNED.get(flag, {})
        for name in flag_names(words):
            if name in owned:
                raise ConfigError(f"{flag}: {name} is set by `dynamod up` for every child it starts; "
                                  f"remove it ({owned[name]})")
