"""`make pr`'s patch applies to the Trinity-RFT 0.6.0 source distribution and its test passes there.

The source distribution comes from PyPI (`pip download`, cached under build/sdist/); the test is
skipped only where it cannot be downloaded. The patch is applied with `git apply --check` and
`git apply`, as a maintainer would, to the unpacked tree, whose files must then equal ours: the
installed, patched trinity-rft files and our modules as the repo holds them. The patch's unit
test then runs against that tree's code, with this environment's packages.
"""

import importlib.metadata
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "build" / "sdist"
SDIST = "trinity_rft-0.6.0.tar.gz"
SITE = Path(str(importlib.metadata.distribution("trinity-rft").locate_file("")))


def run(*cmd: str | Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Run a command with a timeout, so a hang fails the test rather than the suite."""
    full_env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.parent), **env}
    return subprocess.run(
        list(map(str, cmd)), cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    """The unpacked trinity-rft 0.6.0 source distribution."""
    if not (CACHE / SDIST).is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        try:
            done = run(*pip, "trinity-rft==0.6.0", "-d", CACHE, cwd=REPO)
        except subprocess.TimeoutExpired as timeout:
            pytest.skip(f"the trinity-rft 0.6.0 source distribution cannot be had: {timeout}")
        if done.returncode != 0 or not (CACHE / SDIST).is_file():
            pytest.skip(f"the trinity-rft 0.6.0 source distribution cannot be had:\n{done.stderr}")
    unpacked = tmp_path_factory.mktemp("sdist")
    with tarfile.open(CACHE / SDIST) as archive:
        archive.extractall(unpacked, filter="data")
    return unpacked / "trinity_rft-0.6.0"


@pytest.fixture(scope="module")
def patch(tmp_path_factory) -> Path:
    """The patch as `make pr` writes it."""
    output = tmp_path_factory.mktemp("pr") / "trinity-rft-bapo.patch"
    done = run(sys.executable, REPO / "scripts" / "pr" / "make_patch.py", output, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return output


@pytest.fixture(scope="module")
def applied(source_tree: Path, patch: Path) -> list[str]:
    """Apply the patch to the source tree; return the paths it touches."""
    assert (source_tree / "trinity" / "__init__.py").is_file()
    check = run("git", "apply", "--check", patch, cwd=source_tree)
    assert check.returncode == 0, check.stderr
    done = run("git", "apply", patch, cwd=source_tree)
    assert done.returncode == 0, done.stderr
    return re.findall(r"^diff --git a/\S+ b/(\S+)$", patch.read_text(), re.M)


def test_patch_holds_the_series_our_modules_the_example_and_the_unit_test(applied) -> None:
    ours = {str(p.relative_to(REPO)) for p in (REPO / "trinity").rglob("*.py")}
    series = [REPO / "patches" / name for name in (REPO / "patches" / "series").read_text().split()]
    changed = set(re.findall(r"^\+\+\+ b/(\S+)", "".join(p.read_text() for p in series), re.M))
    assert ours and changed and "examples/bapo_gsm8k/gsm8k.yaml" in applied
    assert set(applied) == ours | changed | {
        "examples/bapo_gsm8k/gsm8k.yaml",
        "examples/bapo_gsm8k/README.md",
        "tests/algorithm/bapo_policy_loss_test.py",
    }


def test_every_touched_file_equals_ours(source_tree: Path, applied: list[str]) -> None:
    for rel in applied:
        got = (source_tree / rel).read_bytes()
        if rel.startswith("trinity/"):
            assert got == (SITE / rel).read_bytes(), f"{rel} differs from the installed file"
        if (REPO / rel).is_file():
            assert got == (REPO / rel).read_bytes(), f"{rel} differs from the repo's file"


def test_unit_test_passes_against_the_patched_tree(source_tree: Path, applied: list[str]) -> None:
    where = run(
        sys.executable,
        "-c",
        "import trinity.algorithm.policy_loss_fn.bapo_policy_loss as m; print(m.__file__)",
        cwd=source_tree,
        PYTHONPATH=str(source_tree),
    )
    assert Path(where.stdout.strip()).is_relative_to(source_tree), where.stderr
    done = run(
        sys.executable,
        "-m",
        "unittest",
        "discover",
        "-v",
        "-s",
        "tests/algorithm",
        "-p",
        "bapo_policy_loss_test.py",
        cwd=source_tree,
        PYTHONPATH=str(source_tree),
    )
    assert done.returncode == 0, done.stderr
    assert "Ran 4 tests" in done.stderr and "OK" in done.stderr, done.stderr
