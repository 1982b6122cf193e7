"""The pinned environment: verl's engine imports, and the pins that make it import hold."""

import subprocess
import sys
from importlib.metadata import version

from packaging.version import Version


def test_pins_resolve_to_the_supported_versions():
    trinity = Version(version("trinity-rft"))  # the release, labelled by the wheel of make setup
    assert trinity.base_version == "0.6.0" and str(trinity.local).startswith("bapo.")
    assert version("verl") == "0.8.0"
    assert int(version("numpy").split(".")[0]) < 2  # verl 0.8.0 requires numpy<2


def test_verl_engine_and_trinity_losses_import():
    # A fresh interpreter: the numpy/pyarrow clash shows up only at first import.
    done = subprocess.run(
        [sys.executable, "-c", "import verl.workers.engine, trinity.trainer.verl.losses"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
