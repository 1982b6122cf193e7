"""Tests for scripts/trinity_patches.py, each on a scratch copy of the trinity package.

The released files are rebuilt without the tool under test: a fixture of the whole run copies the
installed (patched) package and its dist-info, drops what pip's RECORD does not list, reverses
patches/series with GNU `patch -R` if needed, and checks every file against RECORD's sha256.
"""

import base64
import difflib
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
from pathlib import Path
from subprocess import CompletedProcess

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


def touched(*names: str) -> list[str]:
    """Site-relative paths the named patches (by default the whole series) change, from headers."""
    lines = "".join((PATCHES / name).read_text() for name in names or series()).splitlines()
    return sorted({line[6:].split()[0] for line in lines if line.startswith("+++ b/")})


def gnu_patch(site: Path, name: str, *flags: str) -> None:
    """Apply one patch (reverse it, with ``-R``) with GNU patch alone, not the tool under test."""
    cmd = ["patch", "-p1", "-s", *flags, "-d", str(site), "-i", str(PATCHES / name)]
    subprocess.run(cmd, check=True, timeout=60)


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


# Runs the tool as its own __main__ after a prelude given as the first argument.
RUN_AFTER = "import runpy, sys; exec(sys.argv.pop(1)); sys.argv[:] = sys.argv[1:]; "
RUN_AFTER += "runpy.run_path(sys.argv[0], run_name='__main__')"
# The prelude that SIGKILLs the tool right after its first `renames` os.replace calls.
KILL_AFTER = """import os, signal
done, replace = [], os.replace
def killing_replace(*args):
    replace(*args)
    done.append(args)
    if len(done) == {renames}:
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = killing_replace
"""

# The prelude under which renaming a copy onto one target fails, as onto an immutable file.
REFUSE_ONE = """import errno, os
replace = os.replace
def refusing_replace(src, dst, *args, **kwargs):
    if str(dst).endswith({target!r}):
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(src), None, str(dst))
    replace(src, dst, *args, **kwargs)
os.replace = refusing_replace
"""


def tool(
    command: str, site: Path, *args: str | Path, status: int = 0, prelude: str = "", wrap=()
) -> CompletedProcess:
    """Run the CLI on `site` the way the Makefile does, in a fresh interpreter; require `status`.

    ``prelude`` runs first in the tool's interpreter; ``wrap`` is a command line prefix.
    """
    first = ["-c", RUN_AFTER, prelude] if prelude else []
    argv = [*wrap, sys.executable, *first, str(TOOL), command, "--site"]
    result = subprocess.run(
        [*argv, *map(str, (site, *args))], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == status, result.stdout + result.stderr
    return result


def refused(command: str, site: Path, *args: str | Path) -> str:
    """Run the CLI, require a clean refusal (no traceback, nothing changed); return its stderr."""
    before = snapshot(site)
    stderr = tool(command, site, *args, status=1).stderr
    assert "Traceback" not in stderr
    assert snapshot(site) == before
    return stderr


def modules() -> list[str]:
    """Site-relative paths of our own modules."""
    found = [p for p in (REPO / "trinity").rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(str(p.relative_to(REPO)) for p in found)


def write(path: Path, text: str) -> Path:
    """Write `text` to `path`, creating its directories; return `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


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
            gnu_patch(site, name, "-R", "-f", "--no-backup-if-mismatch")
    differ = [rel for rel in package_files(site) if sha256(site / rel) != record[rel]]
    assert not differ, f"cannot rebuild the released files from the installed ones: {differ}"
    return site


@pytest.fixture
def site(released: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the released package for one test."""
    shutil.copytree(released, tmp_path / "site", symlinks=True)
    return tmp_path / "site"


@pytest.fixture
def ours(tmp_path: Path) -> Path:
    """An overlay tree of modules of the test's own, to pass as ``--overlay``."""
    return tmp_path / "ours" / "trinity"


def test_apply_twice_is_a_noop(site: Path) -> None:
    tool("apply", site)
    before = snapshot(site)
    stdout = tool("apply", site).stdout
    assert f"0 of {len(series())} patches applied" in stdout
    assert "0 of them copied" in stdout
    assert snapshot(site) == before


def test_refuses_another_trinity_version(site: Path) -> None:
    metadata = site / "trinity_rft-0.6.0.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.6.0", "Version: 0.5.1", 1))
    stderr = refused("apply", site)
    assert "0.5.1" in stderr and "0.6.0" in stderr


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_refuses_a_locally_modified_file(site: Path, command: str) -> None:
    with open(site / LOSSES, "a") as handle:
        handle.write("# local edit\n")
    stderr = refused(command, site)
    assert LOSSES in stderr and sha256(site / LOSSES) in stderr
    assert released_record()[LOSSES] in stderr


def test_apply_completes_a_series_that_grew(site: Path, released: Path, tmp_path: Path) -> None:
    gnu_patch(site, series()[0])  # as if the series had grown by the others since
    stdout = tool("apply", site).stdout
    assert f"{len(series()) - 1} of {len(series())} patches applied" in stdout
    in_one_step = tmp_path / "in_one_step"
    shutil.copytree(released, in_one_step)
    tool("apply", in_one_step)
    assert snapshot(in_one_step, with_times=False) == snapshot(site, with_times=False)


def touched_alone(name: str) -> list:
    """The files patch ``name`` touches and no other patch of the series does."""
    others = {path for other in series() if other != name for path in touched(other)}
    return [path for path in touched(name) if path not in others]


def temporaries(site: Path) -> list[str]:
    """The tool's temporary files (``.NAME.PID.tmp``) anywhere in the package."""
    return [rel for rel in package_files(site) if re.fullmatch(r"\..+\.\d+\.tmp", Path(rel).name)]


@pytest.fixture(scope="session")
def patched(released: Path, tmp_path_factory) -> Path:
    """A site where the tool applied the series and installed our modules."""
    site = tmp_path_factory.mktemp("patched") / "site"
    shutil.copytree(released, site, symlinks=True)
    tool("apply", site)
    return site


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_half_applied_patch_is_completed(site: Path, released: Path, patched: Path, command):
    with_two_files = next(name for name in series() if len(touched_alone(name)) > 1)
    gnu_patch(site, with_two_files)
    first, second = touched_alone(with_two_files)[:2]
    shutil.copyfile(released / first, site / first)
    tool(command, site)
    want = patched if command == "apply" else released
    assert snapshot(site, with_times=False) == snapshot(want, with_times=False)


@pytest.mark.parametrize("renames", [1, 4])
@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_run_killed_between_renames_is_completed_by_the_next(
    site: Path, released: Path, patched: Path, command: str, renames: int, tmp_path: Path
) -> None:
    """SIGKILL after the first rename(s): a mix of released and patched files, and strays.

    ``status`` names the strays; the next ``apply`` and, from a copy of the same state,
    ``revert`` finish the work, and no temporary file survives them.
    """
    if command == "revert":
        tool("apply", site)
    tool(command, site, prelude=KILL_AFTER.format(renames=renames), status=-signal.SIGKILL)
    record = released_record()
    states = {sha256(site / rel) == record[rel] for rel in touched()}
    assert states == {True, False}, "the kill left no mix of released and patched files"
    assert temporaries(site), "the kill left no temporary file"
    stdout = tool("status", site, status=1).stdout
    assert all(f"stray     {rel}" in stdout for rel in temporaries(site)), stdout
    again = tmp_path / "again"
    shutil.copytree(site, again, symlinks=True)
    for command, where, want in (("apply", site, patched), ("revert", again, released)):
        tool(command, where)
        assert snapshot(where, with_times=False) == snapshot(want, with_times=False), command
        assert not temporaries(where)


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_file_modes_are_kept(site: Path, command: str) -> None:
    if command == "revert":
        tool("apply", site)
    modes = dict(zip(touched(), [0o444, 0o600, 0o640, 0o755] * len(touched())))
    for rel, mode in modes.items():
        os.chmod(site / rel, mode)
    tool(command, site)
    assert {rel: stat.S_IMODE((site / rel).stat().st_mode) for rel in modes} == modes


def directories(site: Path) -> list[Path]:
    """The site and every directory under it."""
    return [site, *(path for path in site.rglob("*") if path.is_dir())]


@pytest.fixture
def read_only(site: Path):
    """Make every directory of the site read-only, until the test ends, when called.

    Returns the command prefix under which root, too, obeys the permissions.
    """
    wrap: tuple = ()
    if os.geteuid() == 0:  # root writes anywhere unless it drops these capabilities
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv, which can drop CAP_DAC_OVERRIDE")
        wrap = ("setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--")

    def make_read_only() -> tuple:
        for directory in directories(site):
            directory.chmod(0o555)
        return wrap

    yield make_read_only
    for directory in directories(site):
        directory.chmod(0o755)


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_read_only_site_gives_one_line_naming_the_directory(site: Path, read_only, command):
    if command == "revert":
        tool("apply", site)
    wrap = read_only()
    before = snapshot(site)
    stderr = tool(command, site, status=1, wrap=wrap).stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot {command} in {site}" in lines[0], stderr
    assert "Permission denied" in lines[0]
    assert snapshot(site) == before


def test_refuses_to_shadow_an_upstream_module(site: Path, ours: Path) -> None:
    write(ours / "algorithm" / "policy_loss_fn" / "ppo_policy_loss.py", "# hides PPO's loss\n")
    # The clash is found before patching, so the released files stay as they were.
    stderr = refused("apply", site, "--overlay", ours)
    assert "blocked   trinity/algorithm/policy_loss_fn/ppo_policy_loss.py" in stderr


def test_leaves_a_file_of_the_users_at_a_module_path_alone(site: Path) -> None:
    mine = write(site / modules()[0], "# the user's own\n")
    stderr = refused("apply", site)
    assert f"foreign   {modules()[0]}" in stderr and "remove it by hand" in stderr
    assert f"foreign   {modules()[0]}" in tool("revert", site).stdout
    assert mine.read_text() == "# the user's own\n"


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_never_replaces_or_removes_an_installed_copy_edited_in_place(site: Path, command) -> None:
    tool("apply", site)
    rel = modules()[0]
    with open(site / rel, "a") as handle:
        handle.write("# edited in site-packages\n")
    assert f"modified  {rel}" in refused(command, site)
    assert (site / rel).read_text().endswith("# edited in site-packages\n")


def test_never_removes_an_edited_copy_of_a_module_the_repo_dropped(site: Path, ours: Path) -> None:
    dropped = write(ours / "algorithm" / "bapo_dropped.py", "VALUE = 1\n")
    tool("apply", site, "--overlay", ours)
    installed = site / "trinity" / "algorithm" / "bapo_dropped.py"
    installed.write_text("VALUE = 2  # a hotfix\n")
    dropped.unlink()
    write(ours / "algorithm" / "bapo_kept.py", "VALUE = 1\n")
    for command in ("apply", "revert"):
        assert "modified  trinity/algorithm/bapo_dropped.py" in refused(
            command, site, "--overlay", ours
        )
    assert installed.read_text() == "VALUE = 2  # a hotfix\n"


def test_apply_follows_overlay_changes_and_revert_removes_new_dirs(site: Path, ours: Path) -> None:
    released = snapshot(site, with_times=False)
    old = write(ours / "algorithm" / "policy_loss_fn" / "bapo_old.py", "VALUE = 1\n")
    write(ours / "contrib" / "bapo_extra" / "helpers.py", "VALUE = 1\n")
    installed = site / "trinity" / "algorithm" / "policy_loss_fn"
    extra = site / "trinity" / "contrib"
    tool("apply", site, "--overlay", ours)
    assert (installed / "bapo_old.py").read_text() == "VALUE = 1\n"
    assert (extra / "bapo_extra" / "helpers.py").read_text() == "VALUE = 1\n"
    old.write_text("VALUE = 2\n")
    tool("apply", site, "--overlay", ours)
    assert (installed / "bapo_old.py").read_text() == "VALUE = 2\n"
    old.rename(old.with_name("bapo_new.py"))
    tool("apply", site, "--overlay", ours)
    assert not (installed / "bapo_old.py").exists()
    assert (installed / "bapo_new.py").read_text() == "VALUE = 2\n"
    write(extra / "bapo_extra" / "__pycache__" / "helpers.cpython-311.pyc", "")  # as imports do
    tool("revert", site, "--overlay", ours)
    assert not extra.exists()
    assert snapshot(site, with_times=False) == released


def test_apply_installs_status_reports_and_revert_restores_the_release(site: Path) -> None:
    record = released_record()
    released = snapshot(site, with_times=False)
    tool("status", site, status=1)  # released, nothing installed yet
    tool("apply", site)
    assert all(sha256(site / rel) != record[rel] for rel in touched())
    assert "_runtime_keys" in (site / LOSS_FN).read_text()
    assert modules(), "the repo's trinity/ tree holds no modules to install"
    for rel in modules():
        assert not (site / rel).is_symlink(), rel
        assert (site / rel).read_bytes() == (REPO / rel).read_bytes(), rel
    stdout = tool("status", site).stdout
    for rel in touched():
        assert f"patched   {rel}" in stdout
    for rel in modules():
        assert f"installed {rel}" in stdout
    assert (site / RECORD).is_file()
    tool("revert", site)
    # Same bytes everywhere and nothing left over: no modules, no record, no temporary files.
    assert snapshot(site, with_times=False) == released


def test_without_the_record_revert_restores_the_release(site: Path, released: Path) -> None:
    tool("apply", site)
    (site / RECORD).unlink()
    stdout = tool("status", site, status=1).stdout
    for rel in modules():
        assert f"unrecorded {rel}" in stdout
    assert "`revert` removes it" in stdout
    assert f"{len(modules())} removed" in tool("revert", site).stdout
    # Byte for byte pip's files, and no others: what pip's RECORD lists, as the released copy has.
    record = released_record()
    assert {rel: sha256(site / rel) for rel in package_files(site)} == {
        rel: record[rel] for rel in package_files(released)
    }


def test_without_the_record_apply_adopts_identical_copies(site: Path) -> None:
    tool("apply", site)
    recorded, before = (site / RECORD).read_text(), snapshot(site)
    (site / RECORD).unlink()
    assert "0 of them copied" in tool("apply", site).stdout
    assert (site / RECORD).read_text() == recorded
    after = snapshot(site)
    assert {**after, RECORD: None} == {**before, RECORD: None}  # no module rewritten
    tool("status", site)


def test_status_names_an_unrecorded_older_module_and_revert_leaves_it(site: Path) -> None:
    tool("apply", site)
    (site / RECORD).unlink()
    old = write((site / modules()[0]).with_name("bapo_sync.py"), "# an older copy of ours\n")
    rel = str(old.relative_to(site))
    assert f"foreign   {rel}" in tool("status", site, status=1).stdout
    assert f"foreign   {rel}" in tool("revert", site).stdout
    assert old.is_file() and not (site / modules()[0]).exists()


def test_concurrent_applies_take_turns(released: Path, tmp_path: Path) -> None:
    patched = tmp_path / "patched"
    shutil.copytree(released, patched, symlinks=True)
    tool("apply", patched)
    # Both interpreters start first, then run the CLI at once when their shared stdin closes.
    start = "import runpy, sys; sys.stdin.read(); sys.argv[:] = sys.argv[1:]; "
    code = start + "runpy.run_path(sys.argv[0], run_name='__main__')"
    for trial in range(12):
        site = tmp_path / f"site{trial}"
        shutil.copytree(released, site, symlinks=True)
        argv = [sys.executable, "-c", code, str(TOOL), "apply", "--site", str(site)]
        held, release = os.pipe()
        runs = [
            subprocess.Popen(argv, stdin=held, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for _ in range(2)
        ]
        os.close(held)
        os.close(release)
        try:
            outputs = [run.communicate(timeout=60)[0].decode() for run in runs]
        finally:
            for run in runs:
                run.kill()  # a no-op once it has exited
        assert [run.returncode for run in runs] == [0, 0], f"trial {trial}: {outputs}"
        assert snapshot(site, with_times=False) == snapshot(patched, with_times=False)


# Commits whose series and module differ from this checkout's; the second's series also patched
# a file this one leaves alone (trinity/trainer/verl_legacy/dp_actor.py).
OLD, OLDER = "b3530ff", "f2886fb"


def git(*args: str) -> bytes:
    """A git command in the repository; its stdout."""
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, check=True).stdout


@pytest.fixture(scope="session")
def checkout_at(tmp_path_factory):
    """A function: the patch tool, series and modules of a commit, from the repository's history."""

    def extract(commit: str) -> Path:
        if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO).returncode:
            pytest.skip(f"this checkout's history lacks {commit} (a shallow clone)")
        root = tmp_path_factory.mktemp(commit)
        archive = git("archive", commit, "scripts/trinity_patches.py", "patches", "trinity")
        tarfile.open(fileobj=io.BytesIO(archive)).extractall(root, filter="data")
        return root

    return extract


def patched_at(site: Path, checkout: Path) -> Path:
    """The released package in ``site`` patched by an earlier checkout's own tool and series."""
    old_tool = checkout / "scripts" / "trinity_patches.py"
    cmd = [sys.executable, str(old_tool), "apply", "--site", str(site)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return site


@pytest.fixture
def old_site(site: Path, checkout_at) -> Path:
    """The released package patched by OLD's own tool with OLD's series and modules."""
    return patched_at(site, checkout_at(OLD))


def outdated(old_site: Path, patched: Path) -> list[str]:
    """The files the older series wrote otherwise than this one, neither released nor current."""
    record = released_record()
    found = [rel for rel in package_files(old_site) if (patched / rel).is_file() and rel != RECORD]
    found = [rel for rel in found if sha256(old_site / rel) != sha256(patched / rel)]
    return [rel for rel in found if sha256(old_site / rel) != record.get(rel)]


@pytest.mark.parametrize("commit, first", [(OLD, "apply"), (OLD, "revert"), (OLDER, "apply")])
def test_an_environment_patched_by_an_earlier_commit_is_upgraded_or_reverted(
    site: Path, checkout_at, patched: Path, released: Path, commit: str, first: str
) -> None:
    old_site = patched_at(site, checkout_at(commit))
    older = outdated(old_site, patched)
    assert any(rel in touched() for rel in older) and any(rel in modules() for rel in older)
    stdout = tool("status", old_site, status=1).stdout
    assert all(f"outdated  {rel}" in stdout for rel in older), stdout
    assert "modified" not in stdout and "python scripts/trinity_patches.py apply" in stdout
    tool(first, old_site)
    if first == "apply":
        assert snapshot(old_site, with_times=False) == snapshot(patched, with_times=False)
        tool("status", old_site)
        tool("revert", old_site)
    assert snapshot(old_site, with_times=False) == snapshot(released, with_times=False)


@pytest.mark.parametrize("kind", ["patched file", "module"])
def test_an_edit_in_an_environment_of_an_earlier_commit_survives_apply_and_revert(
    old_site: Path, patched: Path, kind: str
) -> None:
    older = outdated(old_site, patched)
    rel = next(r for r in older if (r in touched()) == (kind == "patched file"))
    with open(old_site / rel, "a") as handle:
        handle.write("# a local fix\n")
    edited = (old_site / rel).read_bytes()
    for command in ("apply", "revert"):
        assert f"modified  {rel}" in refused(command, old_site)
    stdout = tool("status", old_site, status=1).stdout
    assert f"modified  {rel}" in stdout and "move your change away" in stdout
    if kind == "patched file":  # pip's file: reinstalling the release is the other way out
        assert "pip install --force-reinstall" in stdout
    assert (old_site / rel).read_bytes() == edited


def test_without_git_history_an_earlier_series_output_is_refused_with_the_way_out(
    old_site: Path, tmp_path: Path
) -> None:
    export = tmp_path / "export"  # this checkout's tool, series and modules, outside any repository
    for part in ("patches", "trinity"):
        shutil.copytree(REPO / part, export / part)
    write(export / "scripts" / "trinity_patches.py", TOOL.read_text())
    cmd = [sys.executable, str(export / "scripts" / "trinity_patches.py"), "status"]
    done = subprocess.run(
        [*cmd, "--site", str(old_site)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "modified " in done.stdout
    assert "git fetch --unshallow" in done.stdout and "pip install --force-reinstall" in done.stdout


def test_the_release_hashes_for_editable_installs_are_the_wheels() -> None:
    from scripts.trinity_patches import RELEASED

    assert set(touched()) <= set(RELEASED)
    assert RELEASED == {rel: released_record()[rel] for rel in RELEASED}


def pip_uninstall(site: Path) -> None:
    """Remove what pip's RECORD lists, with its bytecode and the directories left empty, as pip."""
    info = next(site.glob("trinity_rft-*.dist-info"))
    for line in (info / "RECORD").read_text().splitlines():
        path = site / line.rsplit(",", 2)[0]
        path.unlink(missing_ok=True)
        for pyc in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
            pyc.unlink()
    shutil.rmtree(info)
    for directory in sorted(directories(site / "trinity"), key=lambda p: -len(p.parts)):
        if not any(directory.iterdir()):
            directory.rmdir()


def bytecode(site: Path, rel: str) -> Path:
    """Write a stand-in for the bytecode that importing module `rel` of `site` caches."""
    return write((site / rel).parent / "__pycache__" / f"{Path(rel).stem}.cpython-311.pyc", "")


def the_way_out(stderr: str, *named: str) -> list[str]:
    """Check a refusal is one line naming `named`; the command between its backticks."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert all(word in lines[0] for word in named), stderr
    return shlex.split(re.findall(r"`([^`]*)`", lines[0])[-1])


def test_after_pip_uninstall_revert_removes_what_of_ours_is_left(
    released: Path, tmp_path: Path
) -> None:
    """Where the running Python's trinity-rft is gone, the tool looks in its site-packages."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    python = venv / "bin" / "python"
    where = [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    site = Path(subprocess.run(where, capture_output=True, text=True, check=True).stdout.strip())
    assert not any(site.iterdir())
    shutil.copytree(released, site, symlinks=True, dirs_exist_ok=True)  # as pip installs it
    subprocess.run([python, TOOL, "apply"], check=True, capture_output=True, timeout=60)
    bytecode(site, modules()[0])
    pip_uninstall(site)
    for command in ("status", "apply"):
        done = subprocess.run([python, TOOL, command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1
        way_out = the_way_out(done.stderr, "not installed", str(site))
    assert way_out[1:] == [str(TOOL), "revert", "--site", str(site)]
    subprocess.run(way_out, check=True, capture_output=True, timeout=60)
    assert not any(site.iterdir())


def test_after_a_move_to_another_version_revert_removes_only_ours(site: Path) -> None:
    tool("apply", site)
    bytecode(site, modules()[0])
    metadata = site / "trinity_rft-0.6.0.dist-info" / "METADATA"  # pip's files, as 0.5.2's
    metadata.write_text(metadata.read_text().replace("Version: 0.6.0", "Version: 0.5.2", 1))
    pips = {rel: sha256(site / rel) for rel in released_record() if (site / rel).is_file()}
    for command in ("status", "apply"):
        way_out = the_way_out(refused(command, site), "0.5.2 is installed", "0.6.0", str(site))
    assert way_out[1:] == [str(TOOL), "revert", "--site", str(site)]
    subprocess.run(way_out, check=True, capture_output=True, timeout=60)
    assert {rel: sha256(site / rel) for rel in package_files(site)} == {
        rel: digest for rel, digest in pips.items() if rel.startswith("trinity/")
    }


@pytest.fixture
def editable(released: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(source tree, site-packages) of an editable install of the release (``pip install -e``).

    The source tree holds the package and setuptools' egg-info; site-packages the metadata, whose
    RECORD lists no file of the package, and a direct_url.json that names the source tree.
    """
    source, packages = tmp_path / "source", tmp_path / "site-packages"
    shutil.copytree(released / "trinity", source / "trinity", symlinks=True)
    metadata = (released / "trinity_rft-0.6.0.dist-info" / "METADATA").read_text()
    write(source / "trinity_rft.egg-info" / "PKG-INFO", metadata)
    info = packages / "trinity_rft-0.6.0.dist-info"
    write(info / "METADATA", metadata)
    write(info / "RECORD", f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    url = {"url": source.as_uri(), "dir_info": {"editable": True}}
    write(info / "direct_url.json", json.dumps(url))
    return source, packages


def test_an_editable_install_is_patched_and_reverted_byte_for_byte(editable) -> None:
    """Found from its metadata by the running Python (here one whose path is the site-packages)."""
    source, packages = editable
    before = snapshot(source, with_times=False)
    python = [sys.executable, "-S"]  # no site-packages but PYTHONPATH's
    env = dict(os.environ, PYTHONPATH=str(packages))

    def run(*args: str, status: int = 0) -> CompletedProcess:
        done = subprocess.run(
            [*python, TOOL, *args], capture_output=True, text=True, timeout=60, env=env
        )
        assert done.returncode == status, done.stdout + done.stderr
        return done

    assert all(f"released  {rel}" in run("status", status=1).stdout for rel in touched())
    run("apply")
    stdout = run("status").stdout
    assert f"(editable) in {source}" in stdout and f"installed {modules()[0]}" in stdout
    assert all(f"patched   {rel}" in stdout for rel in touched())
    assert "editable" in tool("status", source).stdout  # --site names the source tree
    run("revert")
    assert snapshot(source, with_times=False) == before


def test_an_edit_in_an_editable_install_is_refused_with_harmless_advice(editable) -> None:
    source, _ = editable
    with open(source / LOSSES, "a") as handle:
        handle.write("# the developer's change\n")
    for command in ("apply", "revert"):
        stderr = refused(command, source)
        assert f"modified  {LOSSES}" in stderr and "editable install" in stderr
        assert "--unshallow" not in stderr and "--force-reinstall" not in stderr


@pytest.mark.parametrize("command, other", [("apply", "revert"), ("revert", "apply")])
def test_a_failed_rename_says_the_package_is_partly_done_and_what_finishes_it(
    site: Path, released: Path, patched: Path, command: str, other: str, tmp_path: Path
) -> None:
    if command == "revert":
        tool("apply", site)
    last = touched()[-1]  # the last file renamed: the others are done when it fails
    stderr = tool(command, site, prelude=REFUSE_ONE.format(target=last), status=1).stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot {command} in {(site / last).parent}" in lines[0], stderr
    done = "patched" if command == "apply" else "reverted"
    assert f"now partly {done}" in lines[0]
    assert f"`{command}` once the cause is fixed, or `{other}`, finishes it" in lines[0]
    record = released_record()
    assert {sha256(site / rel) == record[rel] for rel in touched()} == {True, False}
    assert not temporaries(site)
    again = tmp_path / "again"
    shutil.copytree(site, again, symlinks=True)
    for finish, where, want in (("apply", site, patched), ("revert", again, released)):
        tool(finish, where)
        assert snapshot(where, with_times=False) == snapshot(want, with_times=False), finish


def newer_checkout(root: Path, patched: Path) -> Path:
    """A checkout of this repository one commit ahead, as a plain tree without git history.

    Its series patches LOSSES once more, and each of its modules differs from ours.
    """
    for part in ("patches", "trinity"):
        shutil.copytree(REPO / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    write(root / "scripts" / "trinity_patches.py", TOOL.read_text())
    ours = (patched / LOSSES).read_text().splitlines(keepends=True)
    diff = difflib.unified_diff(ours, [*ours, "# a newer line\n"], f"a/{LOSSES}", f"b/{LOSSES}")
    write(root / "patches" / "newer-0001.patch", "".join(diff))
    with open(root / "patches" / "series", "a") as handle:
        handle.write("newer-0001.patch\n")
    for rel in modules():
        with open(root / rel, "a") as handle:
            handle.write("# a newer line\n")
    return root


def test_a_newer_checkouts_output_is_named_as_such(
    site: Path, patched: Path, tmp_path: Path
) -> None:
    newer = newer_checkout(tmp_path / "newer", patched)
    cmd = [
        sys.executable,
        str(newer / "scripts" / "trinity_patches.py"),
        "apply",
        "--site",
        str(site),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    stdout = tool("status", site, status=1).stdout
    for rel in (LOSSES, *modules()):
        assert f"newer     {rel}" in stdout, stdout
    assert "may come from a newer checkout of this repository" in stdout
    assert "modified" not in stdout and "outdated" not in stdout and "--unshallow" not in stdout
    for command in ("apply", "revert"):
        stderr = refused(command, site)
        assert f"newer     {LOSSES}" in stderr and "newer checkout" in stderr
        assert "modified" not in stderr and "--unshallow" not in stderr
