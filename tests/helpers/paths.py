"""Where the tests find the repository and their data."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/
REPO = TESTS.parent
TEST_DATA = TESTS / "data"  # small files the tests ship (tests/data/)
SHARED_DATA = REPO.parent / "shared" / "data"  # ShareGPT sample and other data next to the repository
