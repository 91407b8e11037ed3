"""The layering in ``pyproject.toml``'s import-linter contracts holds: libraries import no
application, applications import no other application, only the worker process imports
torch, and no package imports in a circle. A wrong-way import fails here, with
import-linter's report of the offending chain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
