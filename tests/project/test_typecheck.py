"""The package type-checks: ``python -m mypy`` with ``pyproject.toml``'s ``[tool.mypy]``
section (all of ``memserve``) reports no error. mypy's incremental
cache (``.mypy_cache/`` at the repository root, git-ignored) makes a rerun take seconds; a
cold one takes some ten."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_package_type_checks() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, "mypy found errors:\n" + result.stdout + result.stderr
