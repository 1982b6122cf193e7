"""Refuse to test a stale install (the tests and the harness import through pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop before testing copies that differ from the repo.

    Our modules are installed into trinity-rft as copies, so an edit under trinity/ reaches the
    tests only after `make setup` (which `make test` runs) copies it there.
    """
    tool = Path(__file__).resolve().parents[1] / "scripts" / "trinity_patches.py"
    done = subprocess.run(
        [sys.executable, str(tool), "status"], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        pytest.exit(
            "the installed trinity-rft is not patched, or our installed modules differ from "
            f"trinity/; run `make setup` first.\n{done.stdout}{done.stderr}",
            returncode=1,
        )
