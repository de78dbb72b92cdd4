"""``DYN_REQUIRE_NATIVE=1``: a compiled KV core that failed to build is an error, not a quiet
fallback (CI sets it, so a broken compile fails CI instead of skipping the native tests), while
``DYN_KV_INDEX_IMPL=python`` still runs the pure-Python path. Each probe is a fresh interpreter
(the choice is made at import) in which the core is made unimportable, as a failed build leaves it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROBE = (
    "import sys; sys.modules['dynamod.shared.kv._kvcore'] = None\n"  # what a failed build leaves: no core
    "from dynamod.shared.kv import indexer; print(indexer.kv_index_implementation())"
)


def _probe(**env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DYN_KV_INDEX_IMPL", "DYN_REQUIRE_NATIVE")}
    env.update(env_vars)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)


def test_without_the_switch_a_missing_core_falls_back_to_python() -> None:
    done = _probe()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "python"


def test_with_the_switch_a_missing_core_fails_the_import_and_says_why() -> None:
    done = _probe(DYN_REQUIRE_NATIVE="1")
    assert done.returncode != 0
    assert "DYN_REQUIRE_NATIVE=1 but the compiled core" in done.stderr


def test_the_forced_python_run_needs_no_core_even_with_the_switch() -> None:
    done = _probe(DYN_REQUIRE_NATIVE="1", DYN_KV_INDEX_IMPL="python")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "python"


def _build_broken_core(tmp_path: Path, **env_vars: str) -> subprocess.CompletedProcess[str]:
    """Runs the project's setup.py ``build_ext`` on a copy of the C sources with a compile error."""
    shutil.copy(REPO / "setup.py", tmp_path / "setup.py")
    for native in (Path("shared/kv/_native"), Path("daemon/router/core/_native")):
        shutil.copytree(REPO / native, tmp_path / native)
    (tmp_path / "console").mkdir()
    (tmp_path / "dynamod").mkdir()
    (tmp_path / "dynamod" / "__init__.py").write_text("")
    kvcore = tmp_path / "shared" / "kv" / "_native" / "kvcore.c"
    kvcore.write_text("#error broken on purpose by the test\n" + kvcore.read_text())
    env = {k: v for k, v in os.environ.items() if k != "DYN_REQUIRE_NATIVE"}
    env.update(env_vars)
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


needs_compiler = pytest.mark.skipif(
    shutil.which(str(sysconfig.get_config_var("CC") or "cc").split()[0]) is None, reason="no C compiler here"
)


@needs_compiler
def test_a_broken_compile_fails_the_build_only_with_the_switch(tmp_path: Path) -> None:
    for name in ("fallback", "required"):
        (tmp_path / name).mkdir()
    quiet = _build_broken_core(tmp_path / "fallback")
    assert quiet.returncode == 0, quiet.stderr
    assert "compiled core not built" in quiet.stdout + quiet.stderr
    strict = _build_broken_core(tmp_path / "required", DYN_REQUIRE_NATIVE="1")
    assert strict.returncode != 0
    assert "broken on purpose" in strict.stdout + strict.stderr
