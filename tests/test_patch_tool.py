"""Tests for scripts/trinity_patches.py, each run on a scratch copy of the trinity package.

Where the pristine files come from. CI has no wheel to unpack: its only copy of trinity-rft
is the one installed in the venv, which `make setup` has already patched and linked. So the
session fixture copies the installed package (leaving out bytecode caches and symlinks, i.e.
our overlay) and, if it is not the release, reverse-applies patches/series with plain GNU
`patch -R` right here, without the tool under test. The outcome is then checked file by
file against the sha256 hashes pip wrote into the distribution's RECORD when it installed
the released wheel. RECORD knows nothing of our tool or of patches/manifest.json, so this
check is independent of both: if the reverse patching or the installed package is off, the
fixture fails loudly instead of the tests running on files that are not the release.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "scripts" / "trinity_patches.py"
PATCHES = REPO / "patches"
MANIFEST = json.loads((PATCHES / "manifest.json").read_text())
LOSS_FN = "trinity/algorithm/policy_loss_fn/policy_loss_fn.py"


def sha256(path: Path) -> str:
    """Hex sha256 of a file, the form the manifest uses."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_form(hex_digest: str) -> str:
    """A hex sha256 in RECORD's spelling (urlsafe base64, no padding)."""
    return base64.urlsafe_b64encode(bytes.fromhex(hex_digest)).rstrip(b"=").decode()


def series() -> list[str]:
    """Patch names in order, read directly rather than through the tool."""
    lines = (PATCHES / "series").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def plain_patch(root: Path, reverse: bool) -> None:
    """Run the series over `root` with GNU patch alone (last patch first when reversing)."""
    names = list(reversed(series())) if reverse else series()
    for name in names:
        subprocess.run(["patch", "-p1", "-s", "--batch", "--no-backup-if-mismatch",
                        *(["-R"] if reverse else []), "-d", str(root), "-i", str(PATCHES / name)],
                       check=True, timeout=60)


def package_files(site: Path) -> list[str]:
    """Site-relative paths of every file and link in the scratch trinity package."""
    found = []
    for dirpath, dirnames, filenames in os.walk(site / "trinity"):
        found += [str(Path(dirpath, n).relative_to(site)) for n in filenames]
        found += [str(Path(dirpath, n).relative_to(site)) for n in dirnames
                  if Path(dirpath, n).is_symlink()]
    return sorted(found)


def snapshot(site: Path, with_times: bool = True) -> dict[str, tuple]:
    """Content (or link target) and, optionally, mtime of everything in the package: two
    equal snapshots mean nothing was touched."""
    state = {}
    for rel in package_files(site):
        path = site / rel
        content = os.readlink(path) if path.is_symlink() else sha256(path)
        state[rel] = (content, path.lstat().st_mtime_ns) if with_times else (content,)
    return state


def write_metadata(site: Path, version: str) -> None:
    """A minimal dist-info, all the tool reads to learn the installed version."""
    dist_info = site / "trinity_rft-0.6.0.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: trinity-rft\nVersion: {version}\n")


def tool(*args: str | Path) -> subprocess.CompletedProcess:
    """Run the CLI the way the Makefile does, in a fresh interpreter."""
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def overlay_modules() -> list[str]:
    """Site-relative paths of our own modules in the repo."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "trinity").rglob("*.py")
                  if "__pycache__" not in p.parts)


def not_released(directory: str, names: list[str]) -> list[str]:
    """copytree filter: bytecode caches and symlinks (our overlay) are not part of a release."""
    return [n for n in names if n == "__pycache__" or os.path.islink(os.path.join(directory, n))]


@pytest.fixture(scope="session")
def released(tmp_path_factory) -> Path:
    """A site directory holding the released trinity-rft 0.6.0 package (see module doc)."""
    dist = importlib.metadata.distribution("trinity-rft")
    record = {str(f): f.hash.value for f in dist.files or [] if f.hash and f.hash.mode == "sha256"}
    site = tmp_path_factory.mktemp("released")
    shutil.copytree(Path(dist.locate_file("trinity")), site / "trinity", ignore=not_released)
    files = package_files(site)
    if any(record.get(rel) != record_form(sha256(site / rel)) for rel in files):
        plain_patch(site, reverse=True)
    differ = [rel for rel in files if record.get(rel) != record_form(sha256(site / rel))]
    assert not differ, f"cannot rebuild the released files from the installed ones: {differ}"
    write_metadata(site, "0.6.0")
    return site


@pytest.fixture
def site(released: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the released package for one test."""
    copy = tmp_path / "site"
    shutil.copytree(released, copy, symlinks=True)
    return copy


def test_apply_patches_files_and_links_our_modules(site: Path) -> None:
    result = tool("apply", "--site", site)
    assert result.returncode == 0, result.stderr
    for rel, expected in MANIFEST["files"].items():
        assert sha256(site / rel) == expected["patched"], rel
    assert "runtime_keys" in (site / LOSS_FN).read_text()
    modules = overlay_modules()
    assert modules, "the repo's trinity/ tree holds no modules to link"
    for rel in modules:
        link = site / rel
        assert link.is_symlink(), rel
        assert Path(os.readlink(link)) == REPO / rel


def test_apply_twice_is_a_noop(site: Path) -> None:
    assert tool("apply", "--site", site).returncode == 0
    before = snapshot(site)
    result = tool("apply", "--site", site)
    assert result.returncode == 0, result.stderr
    assert "already applied" in result.stdout
    assert snapshot(site) == before


def test_refuses_another_trinity_version(site: Path) -> None:
    write_metadata(site, "0.5.1")
    before = snapshot(site)
    result = tool("apply", "--site", site)
    assert result.returncode != 0
    assert "0.5.1" in result.stderr and "0.6.0" in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(site) == before


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_refuses_a_locally_modified_file(site: Path, command: str) -> None:
    rel = "trinity/trainer/verl/losses.py"
    with open(site / rel, "a") as handle:
        handle.write("# local edit\n")
    before = snapshot(site)
    result = tool(command, "--site", site)
    assert result.returncode == 1
    assert rel in result.stderr and sha256(site / rel) in result.stderr
    assert MANIFEST["files"][rel]["upstream"] in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(site) == before


def test_revert_restores_the_release_and_unlinks(site: Path) -> None:
    released = snapshot(site, with_times=False)
    assert tool("apply", "--site", site).returncode == 0
    assert snapshot(site, with_times=False) != released
    result = tool("revert", "--site", site)
    assert result.returncode == 0, result.stderr
    for rel, expected in MANIFEST["files"].items():
        assert sha256(site / rel) == expected["upstream"], rel
    # Same bytes everywhere and nothing left over: no links, no temporary files.
    assert snapshot(site, with_times=False) == released


def test_manifest_agrees_with_the_series(site: Path, tmp_path: Path) -> None:
    staged = tmp_path / "staged"
    shutil.copytree(site, staged, symlinks=True)
    plain_patch(staged, reverse=False)
    changed = [rel for rel in package_files(site) if sha256(site / rel) != sha256(staged / rel)]
    assert MANIFEST["version"] == "0.6.0"
    assert [entry["patch"] for entry in MANIFEST["series"]] == series()
    assert [entry["sha256"] for entry in MANIFEST["series"]] == [
        sha256(PATCHES / name) for name in series()]
    assert MANIFEST["files"] == {
        rel: {"upstream": sha256(site / rel), "patched": sha256(staged / rel)} for rel in changed}
    # The maintainer command reproduces the committed manifest exactly.
    result = tool("manifest", "--pristine", site, "--output", tmp_path / "manifest.json")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "manifest.json").read_text() == (PATCHES / "manifest.json").read_text()


def test_refuses_to_shadow_an_upstream_module(site: Path, tmp_path: Path) -> None:
    shadow = tmp_path / "ours" / "trinity" / "algorithm" / "policy_loss_fn" / "ppo_policy_loss.py"
    shadow.parent.mkdir(parents=True)
    shadow.write_text("# would hide the upstream PPO loss\n")
    before = snapshot(site)
    result = tool("apply", "--site", site, "--overlay", shadow.parents[2])
    assert result.returncode == 1
    assert "trinity/algorithm/policy_loss_fn/ppo_policy_loss.py" in result.stderr
    # The clash is found before patching, so the released files stay as they were.
    assert snapshot(site) == before


def test_new_directories_are_created_and_removed(site: Path, tmp_path: Path) -> None:
    ours = tmp_path / "ours" / "trinity"
    module = ours / "contrib" / "bapo_extra" / "helpers.py"
    module.parent.mkdir(parents=True)
    module.write_text("VALUE = 1\n")
    released = snapshot(site, with_times=False)
    assert tool("apply", "--site", site, "--overlay", ours).returncode == 0
    link = site / "trinity" / "contrib" / "bapo_extra" / "helpers.py"
    assert Path(os.readlink(link)) == module
    (link.parent / "__pycache__").mkdir()  # as an import would leave behind
    (link.parent / "__pycache__" / "helpers.cpython-311.pyc").write_bytes(b"")
    assert tool("revert", "--site", site, "--overlay", ours).returncode == 0
    assert not (site / "trinity" / "contrib").exists()
    assert snapshot(site, with_times=False) == released


def test_apply_drops_links_to_removed_modules(site: Path, tmp_path: Path) -> None:
    ours = tmp_path / "ours" / "trinity"
    old = ours / "algorithm" / "policy_loss_fn" / "bapo_old.py"
    old.parent.mkdir(parents=True)
    old.write_text("")
    assert tool("apply", "--site", site, "--overlay", ours).returncode == 0
    old.rename(old.with_name("bapo_new.py"))
    result = tool("apply", "--site", site, "--overlay", ours)
    assert result.returncode == 0, result.stderr
    linked = site / "trinity" / "algorithm" / "policy_loss_fn"
    assert not (linked / "bapo_old.py").is_symlink()
    assert (linked / "bapo_new.py").is_symlink()


def test_status_reports_files_and_links(site: Path) -> None:
    assert tool("apply", "--site", site).returncode == 0
    result = tool("status", "--site", site)
    assert result.returncode == 0, result.stderr
    for rel in MANIFEST["files"]:
        assert f"patched   {rel}" in result.stdout
    for rel in overlay_modules():
        assert f"linked    {rel} -> {REPO / rel}" in result.stdout
