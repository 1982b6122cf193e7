"""Tests for scripts/trinity_patches.py, each run on a scratch copy of the trinity package.

Where the released files come from: CI's only copy of trinity-rft is the one installed in the
venv, which `make setup` has already patched and filled with our modules. A fixture shared by the
whole test run copies the installed package and its dist-info, drops every file pip's RECORD
does not list (our modules, bytecode caches) and, if needed, reverse-applies patches/series with
plain GNU `patch -R`, without the tool under test. It then checks every file against the sha256
in RECORD, so the tests never run on files that are not the release.
"""

import base64
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "scripts" / "trinity_patches.py"
PATCHES = REPO / "patches"
RECORD = "trinity/.bapo-installed.json"
LOSS_FN = "trinity/algorithm/policy_loss_fn/policy_loss_fn.py"
LOSSES = "trinity/trainer/verl/losses.py"


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def series() -> list[str]:
    """Patch names in order, read directly rather than through the tool."""
    lines = (PATCHES / "series").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def touched_by(*names: str) -> list[str]:
    """Site-relative paths the named patches change, read directly from their headers."""
    lines = "".join((PATCHES / name).read_text() for name in names).splitlines()
    return sorted({line[6:].split()[0] for line in lines if line.startswith("+++ b/")})


def touched() -> list[str]:
    """Site-relative paths the whole series changes."""
    return touched_by(*series())


def released_record() -> dict[str, str]:
    """Hex sha256 of every released file, as pip recorded it when installing the wheel."""
    dist = importlib.metadata.distribution("trinity-rft")
    hashes = {str(f): f.hash.value for f in dist.files or [] if f.hash and f.hash.mode == "sha256"}
    return {rel: base64.urlsafe_b64decode(value + "==").hex() for rel, value in hashes.items()}


def package_files(site: Path) -> list[str]:
    """Site-relative paths of every file and link in the scratch trinity package."""
    found = []
    for dirpath, dirnames, filenames in os.walk(site / "trinity"):
        links = [n for n in dirnames if Path(dirpath, n).is_symlink()]
        found += [str(Path(dirpath, n).relative_to(site)) for n in filenames + links]
    return sorted(found)


def snapshot(site: Path, with_times: bool = True) -> dict[str, tuple]:
    """Content (or link target) and, optionally, mtime of everything in the package."""
    state = {}
    for rel in package_files(site):
        path = site / rel
        content = os.readlink(path) if path.is_symlink() else sha256(path)
        state[rel] = (content, path.lstat().st_mtime_ns) if with_times else (content,)
    return state


def tool(*args: str | Path) -> subprocess.CompletedProcess:
    """Run the CLI the way the Makefile does, in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=60
    )


def modules(overlay: Path = REPO / "trinity") -> list[str]:
    """Site-relative paths of our own modules."""
    found = [p for p in overlay.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(str(p.relative_to(overlay.parent)) for p in found)


@pytest.fixture(scope="session")
def released(tmp_path_factory) -> Path:
    """A site directory holding the released trinity-rft 0.6.0 package (see module doc)."""
    dist = importlib.metadata.distribution("trinity-rft")
    record, site = released_record(), tmp_path_factory.mktemp("released")
    shutil.copytree(Path(str(dist.locate_file("trinity"))), site / "trinity", symlinks=True)
    info = Path(str(dist.locate_file(f"trinity_rft-{dist.version}.dist-info")))
    shutil.copytree(info, site / info.name)
    for rel in package_files(site):
        if rel not in record:
            (site / rel).unlink()
    if any(sha256(site / rel) != record[rel] for rel in touched()):
        for name in reversed(series()):
            cmd = ["patch", "-p1", "-s", "-R", "-f", "--no-backup-if-mismatch", "-d", str(site)]
            subprocess.run([*cmd, "-i", str(PATCHES / name)], check=True, timeout=60)
    differ = [rel for rel in package_files(site) if sha256(site / rel) != record[rel]]
    assert not differ, f"cannot rebuild the released files from the installed ones: {differ}"
    return site


@pytest.fixture
def site(released: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the released package for one test."""
    shutil.copytree(released, tmp_path / "site", symlinks=True)
    return tmp_path / "site"


def test_apply_patches_files_and_installs_our_modules_as_files(site: Path) -> None:
    record = released_record()
    result = tool("apply", "--site", site)
    assert result.returncode == 0, result.stderr
    assert all(sha256(site / rel) != record[rel] for rel in touched())
    assert "_runtime_keys" in (site / LOSS_FN).read_text()
    assert modules(), "the repo's trinity/ tree holds no modules to install"
    for rel in modules():
        assert not (site / rel).is_symlink(), rel
        assert (site / rel).read_bytes() == (REPO / rel).read_bytes(), rel


def test_apply_twice_is_a_noop(site: Path) -> None:
    assert tool("apply", "--site", site).returncode == 0
    before = snapshot(site)
    result = tool("apply", "--site", site)
    assert result.returncode == 0, result.stderr
    assert f"0 of {len(series())} patches applied" in result.stdout
    assert "0 of them copied" in result.stdout
    assert snapshot(site) == before


def test_refuses_another_trinity_version(site: Path) -> None:
    metadata = site / "trinity_rft-0.6.0.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.6.0", "Version: 0.5.1", 1))
    before = snapshot(site)
    result = tool("apply", "--site", site)
    assert result.returncode == 1
    assert "0.5.1" in result.stderr and "0.6.0" in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(site) == before


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_refuses_a_locally_modified_file(site: Path, command: str) -> None:
    with open(site / LOSSES, "a") as handle:
        handle.write("# local edit\n")
    before = snapshot(site)
    result = tool(command, "--site", site)
    assert result.returncode == 1
    assert LOSSES in result.stderr and sha256(site / LOSSES) in result.stderr
    assert released_record()[LOSSES] in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(site) == before


def plain_patch(site: Path, name: str) -> None:
    """Apply one patch with GNU patch alone, as if the series had grown by the others since."""
    cmd = ["patch", "-p1", "-s", "-d", str(site), "-i", str(PATCHES / name)]
    subprocess.run(cmd, check=True, timeout=60)


def test_apply_completes_a_series_that_grew(site: Path, released: Path, tmp_path: Path) -> None:
    plain_patch(site, series()[0])
    result = tool("apply", "--site", site)
    assert result.returncode == 0, result.stderr
    assert f"{len(series()) - 1} of {len(series())} patches applied" in result.stdout
    in_one_step = tmp_path / "in_one_step"
    shutil.copytree(released, in_one_step)
    assert tool("apply", "--site", in_one_step).returncode == 0
    assert snapshot(in_one_step, with_times=False) == snapshot(site, with_times=False)


def test_refuses_a_half_applied_patch(site: Path, released: Path) -> None:
    with_two_files = next(name for name in series() if len(touched_by(name)) > 1)
    plain_patch(site, with_two_files)
    first = touched_by(with_two_files)[0]
    shutil.copyfile(released / first, site / first)
    before = snapshot(site)
    result = tool("apply", "--site", site)
    assert result.returncode == 1
    assert f"released  {first}" in result.stderr
    assert f"patched   {touched_by(with_two_files)[1]}" in result.stderr
    assert snapshot(site) == before


def test_revert_restores_the_release_byte_for_byte(site: Path) -> None:
    released = snapshot(site, with_times=False)
    assert tool("apply", "--site", site).returncode == 0
    assert snapshot(site, with_times=False) != released
    result = tool("revert", "--site", site)
    assert result.returncode == 0, result.stderr
    # Same bytes everywhere and nothing left over: no modules, no record, no temporary files.
    assert snapshot(site, with_times=False) == released


def test_refuses_to_shadow_an_upstream_module(site: Path, tmp_path: Path) -> None:
    shadow = tmp_path / "ours" / "trinity" / "algorithm" / "policy_loss_fn" / "ppo_policy_loss.py"
    shadow.parent.mkdir(parents=True)
    shadow.write_text("# would hide the upstream PPO loss\n")
    before = snapshot(site)
    result = tool("apply", "--site", site, "--overlay", shadow.parents[2])
    assert result.returncode == 1
    assert "trinity/algorithm/policy_loss_fn/ppo_policy_loss.py (blocked)" in result.stderr
    # The clash is found before patching, so the released files stay as they were.
    assert snapshot(site) == before


def test_refuses_to_overwrite_an_installed_copy_edited_in_place(site: Path) -> None:
    assert tool("apply", "--site", site).returncode == 0
    rel = modules()[0]
    with open(site / rel, "a") as handle:
        handle.write("# edited in site-packages\n")
    result = tool("apply", "--site", site)
    assert result.returncode == 1
    assert f"{rel} (modified)" in result.stderr
    assert (site / rel).read_text().endswith("# edited in site-packages\n")


def test_apply_recopies_changed_modules_and_drops_removed_ones(site: Path, tmp_path: Path) -> None:
    ours = tmp_path / "ours" / "trinity"
    old = ours / "algorithm" / "policy_loss_fn" / "bapo_old.py"
    old.parent.mkdir(parents=True)
    old.write_text("VALUE = 1\n")
    assert tool("apply", "--site", site, "--overlay", ours).returncode == 0
    installed = site / "trinity" / "algorithm" / "policy_loss_fn"
    assert (installed / "bapo_old.py").read_text() == "VALUE = 1\n"
    old.write_text("VALUE = 2\n")
    assert tool("apply", "--site", site, "--overlay", ours).returncode == 0
    assert (installed / "bapo_old.py").read_text() == "VALUE = 2\n"
    old.rename(old.with_name("bapo_new.py"))
    result = tool("apply", "--site", site, "--overlay", ours)
    assert result.returncode == 0, result.stderr
    assert not (installed / "bapo_old.py").exists()
    assert (installed / "bapo_new.py").read_text() == "VALUE = 2\n"


def test_new_directories_are_created_and_removed(site: Path, tmp_path: Path) -> None:
    ours = tmp_path / "ours" / "trinity"
    module = ours / "contrib" / "bapo_extra" / "helpers.py"
    module.parent.mkdir(parents=True)
    module.write_text("VALUE = 1\n")
    released = snapshot(site, with_times=False)
    assert tool("apply", "--site", site, "--overlay", ours).returncode == 0
    installed = site / "trinity" / "contrib" / "bapo_extra" / "helpers.py"
    assert installed.read_text() == "VALUE = 1\n"
    (installed.parent / "__pycache__").mkdir()  # as an import would leave behind
    (installed.parent / "__pycache__" / "helpers.cpython-311.pyc").write_bytes(b"")
    assert tool("revert", "--site", site, "--overlay", ours).returncode == 0
    assert not (site / "trinity" / "contrib").exists()
    assert snapshot(site, with_times=False) == released


def test_status_reports_files_and_modules(site: Path) -> None:
    result = tool("status", "--site", site)
    assert result.returncode == 1  # released, nothing installed yet
    assert tool("apply", "--site", site).returncode == 0
    result = tool("status", "--site", site)
    assert result.returncode == 0, result.stdout + result.stderr
    for rel in touched():
        assert f"patched   {rel}" in result.stdout
    for rel in modules():
        assert f"installed {rel}" in result.stdout
    assert (site / RECORD).is_file()
