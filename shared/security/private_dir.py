"""Per-user private directories for state that other local users must neither read nor steer.

File discovery (``/tmp/dynamod-UID/discovery``) says where prompts go: a local user who created
that directory first (``/tmp`` is shared) would own it and could write instance records that point
a frontend at their own listener. The mocker's disk tier holds KV blocks, i.e. prompt content.
So every such directory is created ``0700``, and an existing one is accepted only when it is a real
directory (not a symlink), owned by this user; one we own with looser permissions is tightened
(and logged); anything else is refused with a ``ConfigError`` that says what to do.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from dynamod.shared.errors import ConfigError

logger = logging.getLogger(__name__)


def user_runtime_dir() -> Path:
    """``${XDG_RUNTIME_DIR:-/tmp}/dynamod-<uid>``: the per-user root of this project's local state."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"  # noqa: S108 - made private below, owner checked
    return Path(base) / f"dynamod-{os.getuid()}"


def _check_one(path: Path, what: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"{what}: cannot create {path}: {exc.strerror or exc}") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what}: {path} is not a plain directory (a symlink or a file); remove it or choose another")
    uid = os.getuid()
    if st.st_uid != uid:
        raise ConfigError(
            f"{what}: {path} belongs to uid {st.st_uid}, not to this user ({uid}); another user may have created it "
            "to read or redirect this cluster's state: remove it or choose another directory"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
        logger.warning("private_dir.tightened path=%s was=%o now=700 what=%s", path, stat.S_IMODE(st.st_mode), what)


def private_root_for(path: str | os.PathLike[str]) -> Path:
    """Where ``path``'s private chain starts: the per-user runtime directory when ``path`` lies in
    it (so ``/tmp/dynamod-UID`` itself is checked too), else ``path``."""
    target = Path(path).absolute()
    runtime = user_runtime_dir().absolute()
    return runtime if runtime == target or runtime in target.parents else target


def ensure_private_dir(path: str | os.PathLike[str], *, what: str, owned_from: str | os.PathLike[str] | None = None) -> Path:
    """Creates ``path`` (0700) and checks it and every directory from ``owned_from`` down to it
    (``owned_from`` None: ``path`` alone). Blocking: call from a thread or at start-up."""
    target = Path(path).absolute()
    top = Path(owned_from).absolute() if owned_from is not None else target
    if top != target and top not in target.parents:
        top = target
    if not top.parent.is_dir():
        os.makedirs(top.parent, exist_ok=True)  # above the private part: ordinary directories
    chain = [top, *(p for p in reversed(target.parents) if top in p.parents)]
    if target != top:
        chain.append(target)
    for directory in chain:
        _check_one(directory, what)
    return target
