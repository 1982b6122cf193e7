"""`make wheel`: the release wheel patched as the series says, installed and removed by pip alone.

The wheel is checked against independent sources: the 0.6.0 source distribution with the series
applied by ``git apply`` (its ``trinity/``), and ``hashlib`` over every file its RECORD lists. A
scratch venv installs it with ``pip --no-deps``; the pins' other packages (torch, verl) are read
from this environment through a ``.pth`` line after its own site-packages, so that ``trinity`` is
the scratch venv's.
"""

import base64
import csv
import hashlib
import io
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from scripts import make_wheel
from scripts.make_pr import git, unpack
from scripts.make_wheel import RELEASE, REPO, label

LOSS = """
import torch, trinity
from trinity.algorithm import POLICY_LOSS_FN
torch.manual_seed(0)
lp, old, adv = torch.randn(3, 2, 8).unbind()
loss, metrics = POLICY_LOSS_FN.get("bapo")()(lp, old, torch.ones(2, 8), adv)
print(trinity.__file__, float(loss), metrics["bapo_clip_low"], metrics["bapo_clip_high"])
"""


def run(*cmd, **kwargs) -> subprocess.CompletedProcess:
    """A command with a timeout, its output kept."""
    return subprocess.run(
        list(map(str, cmd)), capture_output=True, text=True, timeout=600, **kwargs
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``make wheel`` writes, built into a folder of the test's."""
    return make_wheel.build(dist=tmp_path_factory.mktemp("dist"))


def series() -> list[Path]:
    """The series' patches, in order."""
    return [REPO / "patches" / name for name in (REPO / "patches" / "series").read_text().split()]


def members(wheel: Path) -> dict:
    """The wheel's files, by path, as bytes."""
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist() if not name.endswith("/")}


def test_the_wheel_is_named_by_the_release_and_the_label(wheel) -> None:
    assert wheel.name == f"trinity_rft-{RELEASE}+{label()}-py3-none-any.whl"
    metadata = members(wheel)[f"trinity_rft-{RELEASE}+{label()}.dist-info/METADATA"].decode()
    assert f"\nVersion: {RELEASE}+{label()}\n" in metadata
    assert "\nRequires-Python: <3.13,>=3.10\n" in metadata  # the release's range, kept


def test_its_trinity_is_the_sdist_with_the_series_applied_and_our_modules(wheel, tmp_path) -> None:
    tree = unpack(tmp_path)
    for patch in series():
        git(tree, "apply", str(patch))
    files = {k: v for k, v in members(wheel).items() if k.startswith("trinity/")}
    shared = [rel for rel in files if (tree / rel).is_file()]
    assert [rel for rel in shared if files[rel] != (tree / rel).read_bytes()] == []
    patched = re.findall(r"^\+\+\+ b/(\S+)", "".join(map(Path.read_text, series())), re.M)
    assert patched and set(patched) <= set(shared)
    ours = sorted(str(p.relative_to(REPO)) for p in (REPO / "trinity").rglob("*.py"))
    assert ours and all(files[rel] == (REPO / rel).read_bytes() for rel in ours)
    assert sorted(set(files) - set(shared)) == ours  # nothing else the sdist lacks


def test_every_record_hash_holds_and_every_file_is_recorded(wheel) -> None:
    files = members(wheel)
    (record,) = [name for name in files if name.endswith(".dist-info/RECORD")]
    rows = list(csv.reader(io.StringIO(files[record].decode())))
    assert sorted(path for path, _, _ in rows) == sorted(files)
    for path, digest, size in rows:
        if path == record:
            continue
        raw = hashlib.sha256(files[path]).digest()
        assert digest == "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode(), path
        assert int(size) == len(files[path]), path


def test_the_label_follows_every_patch_and_module(tmp_path) -> None:
    for part in ("patches", "trinity"):
        shutil.copytree(REPO / part, tmp_path / part)
    assert label(tmp_path) == label()
    for edited in ["patches/" + (REPO / "patches" / "series").read_text().split()[-1], None]:
        edited = edited or str(make_wheel.sources(tmp_path)[-1].relative_to(tmp_path))
        before = label(tmp_path)
        with open(tmp_path / edited, "a") as file:
            file.write("\n")
        assert label(tmp_path) != before, edited


def scratch_venv(where: Path) -> tuple[Path, Path]:
    """A new venv (with pip) and its site-packages."""
    assert run(sys.executable, "-m", "venv", where).returncode == 0
    python = where / "bin" / "python"
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    return python, Path(site.stdout.strip())


def test_pip_installs_shows_and_uninstalls_it_and_bapo_computes_a_loss(
    wheel, tmp_path, capsys
) -> None:
    """Installed as `make setup` installs it: once, then never again while the label holds."""
    python, site = scratch_venv(tmp_path / "venv")
    for _ in range(2):
        make_wheel.main(["--install", str(python)])
    said = capsys.readouterr().out
    assert said.count(f"installed trinity-rft {RELEASE}+{label()} into {python}") == 1, said
    shown = run(python, "-m", "pip", "show", "trinity-rft").stdout
    assert f"\nVersion: {RELEASE}+{label()}\n" in shown
    (site / "pins.pth").write_text(sysconfig.get_path("purelib") + "\n")
    done = run(python, "-c", LOSS, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    where, loss, low, high = done.stdout.split()
    assert Path(where).is_relative_to(site) and float(loss) == float(loss)  # not NaN
    assert 0.6 <= float(low) <= 0.9 and 1.2 <= float(high) <= 3.0
    (site / "pins.pth").unlink()
    assert run(python, "-m", "pip", "uninstall", "-y", "trinity-rft").returncode == 0
    assert not (site / "trinity").exists()


def test_one_command_moves_an_environment_patched_in_place_to_the_wheel(wheel, tmp_path) -> None:
    """The in-place state of earlier releases: patched files, our module, its hash record."""
    python, site = scratch_venv(tmp_path / "venv")
    release = make_wheel.DOWNLOADS / f"trinity_rft-{RELEASE}-py3-none-any.whl"
    assert run(python, "-m", "pip", "install", "--no-deps", release).returncode == 0
    for patch in series():
        assert run("git", "apply", patch, cwd=site).returncode == 0
    module = "trinity/algorithm/policy_loss_fn/bapo_policy_loss.py"
    (site / module).write_text("# an older copy\n")
    (site / "trinity" / ".bapo-installed.json").write_text("{}\n")
    move = run(python, "-m", "pip", "install", "--force-reinstall", "--no-deps", wheel)
    assert move.returncode == 0, move.stderr
    assert (
        f"\nVersion: {RELEASE}+{label()}\n"
        in run(python, "-m", "pip", "show", "trinity-rft").stdout
    )
    files = members(wheel)
    assert all(
        (site / rel).read_bytes() == data
        for rel, data in files.items()
        if rel.startswith("trinity/")
    )


def one_line_refusal(tmp_path, monkeypatch, **pip_env) -> str:
    """What ``build`` exits with when pip sees ``pip_env``; nothing is written to dist."""
    for key, value in pip_env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as refused:
        make_wheel.build(dist=tmp_path / "dist", downloads=tmp_path / "downloads")
    assert not (tmp_path / "dist").exists()
    message = str(refused.value.code)
    assert len(message.splitlines()) == 1, message
    return message


def test_a_release_wheel_of_other_bytes_is_refused_in_one_line(
    wheel, tmp_path, monkeypatch
) -> None:
    forged = tmp_path / "index" / f"trinity_rft-{RELEASE}-py3-none-any.whl"
    forged.parent.mkdir()
    shutil.copyfile(make_wheel.DOWNLOADS / forged.name, forged)
    with zipfile.ZipFile(forged, "a") as archive:
        archive.writestr("trinity/extra.py", "")
    message = one_line_refusal(
        tmp_path, monkeypatch, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(forged.parent)
    )
    assert hashlib.sha256(forged.read_bytes()).hexdigest() in message and "refused" in message


def test_no_index_to_fetch_from_is_said_in_one_line(tmp_path, monkeypatch) -> None:
    message = one_line_refusal(tmp_path, monkeypatch, PIP_NO_INDEX="1")
    assert (
        message.startswith(f"cannot fetch the trinity-rft {RELEASE} wheel: ") and "0.6.0" in message
    )


def test_a_patch_that_does_not_apply_is_named_with_its_file(tmp_path, monkeypatch) -> None:
    root = tmp_path / "checkout"
    for part in ("patches", "trinity"):
        shutil.copytree(REPO / part, root / part)
    shutil.copyfile(REPO / make_wheel.PIN, root / make_wheel.PIN)
    name = (root / "patches" / "series").read_text().split()[-1]
    text = (root / "patches" / name).read_text()
    context = next(line for line in text.splitlines() if line.startswith(" ") and line.strip())
    (root / "patches" / name).write_text(text.replace(context, context + " # changed", 1))
    with pytest.raises(SystemExit) as refused:
        make_wheel.build(dist=tmp_path / "dist", root=root)
    assert not (tmp_path / "dist").exists()
    touched = next(line[6:] for line in text.splitlines() if line.startswith("+++ b/"))
    message = str(refused.value.code)
    assert (
        message.startswith(f"patches/{name} does not apply to {touched} ") and "\n" not in message
    )


def outside_python() -> str | None:
    """A Python outside the release's range (3.10 to 3.12) that runs: on PATH, or pyenv's."""
    found = [shutil.which(f"python3.{minor}") for minor in (13, 14, 9)]
    if shutil.which("pyenv"):
        versions = run("pyenv", "versions", "--bare").stdout.split()
        for version in (v for v in versions if re.fullmatch(r"3\.(9|1[34])\.\d+", v)):
            prefix = Path(run("pyenv", "prefix", version).stdout.strip())
            found.append(str(prefix / "bin" / "python3"))
    return next((p for p in found if p and run(p, "-c", "").returncode == 0), None)


@pytest.mark.skipif(not outside_python(), reason="no Python outside 3.10 to 3.12 here")
def test_a_python_outside_the_releases_range_is_refused_in_one_line(wheel, tmp_path) -> None:
    venv = tmp_path / "venv"
    assert run(outside_python(), "-m", "venv", venv).returncode == 0
    with pytest.raises(SystemExit) as refused:
        make_wheel.install(str(venv / "bin" / "python"), wheel)
    message = str(refused.value.code)
    assert "requires a different Python" in message and "\n" not in message, message
    assert not list((venv / "lib").glob("python3.*/site-packages/trinity*"))
