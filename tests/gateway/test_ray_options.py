"""``memserve up --ray`` refuses what cannot work with a clear message before it starts
anything (Ray not installed, ipc transport, spare workers), and without ``--ray``
nothing that ``memserve up`` imports brings Ray in (import-linter cannot see the
function-level import that ``--ray`` takes). None of these needs Ray installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from helpers.paths import REPO

from memserve.cli import main


@pytest.mark.parametrize(("flags", "message"), [
    (["--internal-transport", "ipc"], "--ray needs --internal-transport tcp"),
    (["--spare-workers", "1"], "--spare-workers starts local processes"),
])
def test_ray_refuses_flags_it_cannot_serve_with(flags, message, capsys, monkeypatch):
    find_spec = importlib.util.find_spec  # as if Ray were installed:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object() if name == "ray" else find_spec(name))
    assert main(["up", "--ray", "auto", *flags]) == 2
    assert message in capsys.readouterr().err


def test_ray_not_installed_is_a_clear_error(capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "ray" else find_spec(name))
    assert main(["up", "--ray"]) == 2
    assert "pip install 'memserve[ray]'" in capsys.readouterr().err


def test_memserve_up_without_the_flag_imports_no_ray():
    code = ("import sys, memserve.cli, memserve.gateway.server, memserve.gateway.cluster; "
            "memserve.cli.build_parser().parse_args(['up']); sys.exit(int('ray' in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, "ray imported without --ray:\n" + result.stderr
