"""Process lifecycle shared by every role: event loop, signals, clean exit codes.

A role's ``run(args, stop)`` coroutine serves until ``stop`` is set by SIGTERM/SIGINT, then shuts
down in its own order (deregister, finish in-flight work, close) and returns an exit code. A second
signal during shutdown exits at once. Errors of the ``DynamoError`` family become one line on stderr
and exit code 1, never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

from dynamod.shared.errors import DynamoError

logger = logging.getLogger(__name__)

RoleMain = Callable[[asyncio.Event], Awaitable[int | None]]


def _install_uvloop() -> None:
    """uvloop makes the request plane and HTTP noticeably cheaper; fall back to asyncio without it."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_role(main: RoleMain, *, name: str) -> int:
    """Runs ``main(stop_event)`` on a fresh (uvloop) loop and returns its exit code."""
    _install_uvloop()

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals_seen = 0

        def on_signal(signum: int) -> None:
            nonlocal signals_seen
            signals_seen += 1
            if signals_seen == 1:
                logger.info("signal received role=%s signal=%s action=shutdown", name, signal.Signals(signum).name)
                stop.set()
            else:
                logger.warning("second signal received role=%s action=exit-now", name)
                sys.stderr.flush()
                os._exit(130)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        code = await main(stop)
        return int(code or 0)

    try:
        return asyncio.run(runner())
    except DynamoError as exc:
        print(f"dynamod {name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
