"""The house rules on imports hold over the whole product tree (issue 29): no import circles, no
use of another module's private names, and the layers point one way (``shared`` below ``daemon``
and ``console``; engines below the worker). scripts/import_graph.py reads the source with ``ast``
and is the check a developer runs by hand; this runs it on every suite run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_product_tree_keeps_the_import_rules() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "import_graph.py"), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode in (0, 1), done.stderr
    findings = json.loads(done.stdout)
    assert done.returncode == 0, json.dumps(findings, indent=1)
