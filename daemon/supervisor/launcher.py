"""The one way ``dynamod up`` starts a child: ``python -P -m dynamod.daemon.cli ...``.

``-P`` (Python 3.11+) keeps the working directory off ``sys.path``. Without it, ``python -m`` puts
the directory ``dynamod up`` was started from first on the path, so a folder named ``dynamod``
there (the parent of a clone of this repository, for one) shadows the installed package and every
child dies at import. ``PYTHONSAFEPATH=1`` in the child's environment does the same for the
processes a child starts in turn (the frontend's copies with ``--num-frontends``, KV transfer
peers), which run ``sys.executable -m`` themselves.
"""

from __future__ import annotations

import os
import ssl
import sys
from collections.abc import Mapping, Sequence

from dynamod.daemon.supervisor.children import ChildSpec

CLI_MODULE = "dynamod.daemon.cli"


def daemon_argv(args: Sequence[str]) -> list[str]:
    """The command line of a ``dynamod`` child with ``args`` (``--role ...``)."""
    return [sys.executable, "-P", "-m", CLI_MODULE, *args]


def daemon_env(overrides: Mapping[str, str] | None = None, *, drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment with ``overrides``, without ``drop``, and safe-path on."""
    env = {**os.environ, **(overrides or {})}
    for key in drop:
        env.pop(key, None)
    env["PYTHONSAFEPATH"] = "1"
    return env


def daemon_child(
    name: str, args: Sequence[str], *, env: Mapping[str, str], live_url: str | None = None,
    live_ssl: ssl.SSLContext | None = None,
) -> ChildSpec:
    """A supervised ``dynamod`` child: every child of ``dynamod up`` is built here."""
    return ChildSpec(name, daemon_argv(args), live_url=live_url, live_ssl=live_ssl, env=dict(env))
