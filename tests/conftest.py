"""Refuse to test a stale install; the one driver of the launched checks (``tests.ranks``).

The longest test files are collected first, so that pytest-xdist's workers, which take the files
in that order (``make test``), finish together rather than one waiting on another's last file.
"""

from importlib.metadata import version
from pathlib import Path

import pytest

from scripts.harness.launch import tail, torchrun
from scripts.make_wheel import RELEASE, label
from tests.ranks import rank_records


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop before testing an install that is not the wheel of this checkout (`make setup`)."""
    expected, installed = f"{RELEASE}+{label()}", version("trinity-rft")
    if installed != expected:
        pytest.exit(
            f"the installed trinity-rft is {installed}, not {expected}, the wheel of patches/ "
            "and trinity/ as they are now; run `make setup` first",
            returncode=1,
        )


# the files that take longest, longest first (worker-seconds on 2 cores: about 210, 165, 125, 80,
# 50, 40, 30, 13, 10 and 8), so that the workers, each taking the next file when it is free, end
# together
SLOW_FILES = (
    "test_scripts.py",
    "test_trinity_run.py",
    "test_engine.py",
    "test_make_pr.py",
    "test_launchers.py",
    "test_wheel.py",
    "test_bapo_distributed.py",
    "test_bapo_loss.py",
    "test_environment.py",
    "test_bapo_config.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    """Put the slow files' tests first, each file's in its own order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


class Launches:
    """Launches of a check module on torchrun, one per key, cached for the test run."""

    def __init__(self, root: Path):
        """Launch outputs go under ``root``."""
        self.root, self.done = root, dict[str, tuple]()

    def records(self, key, nproc, module, checks, backend="gloo", timeout=150, **options):
        """(launch, per-rank records) of one launch; options reach the checks with ``out``."""
        if key not in self.done:
            out = self.root / key
            out.mkdir()
            # a hung rank's peers fail within the launch's timeout
            argv = ["--out", out, "--checks", ",".join(checks), "--backend", backend]
            argv += ["--group-timeout", timeout / 3]
            for name, value in {"out": out, **options}.items():
                argv += ["--option", f"{name}={value}"]
            launch = torchrun(nproc, module, argv, timeout)
            self.done[key] = (launch, rank_records(out, nproc))
        return self.done[key]

    def check(self, key, name, *args, **kwargs):
        """Per-rank results of check ``name``, or a failure saying what went wrong where."""
        launch, records = self.records(key, *args, **kwargs)
        problems = []
        for rank, record in enumerate(records):
            result = None if record is None else record["checks"].get(name)
            if result is None:
                problems.append(f"rank {rank}: no result")
            elif "error" in result:
                problems.append(f"rank {rank} raised:\n{result['error']}")
        if problems:
            status = "timed out" if launch.code is None else f"exit code {launch.code}"
            where = f"{key}, check {name!r}: {status} after {launch.seconds:.0f} s"
            pytest.fail("\n".join([where, *problems, "--- stderr ---", tail(launch.err)]))
        return [record["checks"][name] for record in records]


@pytest.fixture(scope="session")
def launches(tmp_path_factory) -> Launches:
    """The launches of one test run, shared by its tests."""
    return Launches(tmp_path_factory.mktemp("launches"))
