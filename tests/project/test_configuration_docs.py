"""docs/configuration.md is generated from the command line's flags and must match them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "configuration_docs.py"
DOC = ROOT / "docs" / "configuration.md"


def _generator():
    spec = importlib.util.spec_from_file_location("configuration_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_matches_the_flags():
    expected = _generator().render()
    current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    assert current == expected, (
        "docs/configuration.md is out of date with memserve's command-line flags; "
        "regenerate it with `python scripts/configuration_docs.py`"
    )


def test_every_subcommand_and_flag_is_listed():
    text = _generator().render()
    for command in ("memserve up", "memserve profile", "memserve bench", "memserve bench compare",
                    "memserve simulate"):
        assert f"## `{command}`" in text
    for flag in ("`--router`", "`--pd-mode`", "`--eviction-policy`", "`--workload`", "`--cost-model`"):
        assert flag in text
    assert "`--help`" not in text


def test_defaults_do_not_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("MEMSERVE_CPU_THREADS_BIND", "0-1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-the-docs")
    text = _generator().render()
    assert "sk-not-for-the-docs" not in text
    assert "Default from `OPENAI_API_KEY` when set." in text
    assert "Default from `MEMSERVE_CPU_THREADS_BIND` when set." in text
