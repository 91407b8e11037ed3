"""scripts/gpu_check and scripts/gpu_wheels, which run where this suite cannot (a GPU
machine without network; the registry): both parse, and gpu_check's dry run takes every
step on the CPU (dependencies resolved from .whl/ if it is there, a tiny random model, the
CUDA tests skipping, each benchmark for a few steps) and reports each as ok."""

from __future__ import annotations

import subprocess

import pytest
from helpers.paths import REPO

SCRIPTS = [REPO / "scripts" / "gpu_check", REPO / "scripts" / "gpu_wheels"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.slow
def test_dry_run_takes_every_step(tmp_path):
    result = subprocess.run([str(SCRIPTS[0]), str(tmp_path), "--dry-run"], capture_output=True, text=True,
                            timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    rows = summary[[line.split()[:1] for line in summary].index(["step"]) + 1 :]
    steps = {line.split()[0]: line.split()[1] for line in rows}
    expected = {step: "ok" for step in ("setup", "tests", "roofline", "backends", "decode", "preload", "transfer",
                                        "pd", "slo")}
    assert steps == expected, "\n".join(summary)
    assert "skipped" in (tmp_path / "tests.log").read_text()  # no CUDA here: the CUDA tests skip, cleanly
