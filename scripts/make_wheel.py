"""``make wheel``: trinity-rft 0.6.0 with BAPO, one wheel that pip installs, shows and uninstalls.

The released wheel, fetched by pip with its sha256 pinned (``trinity-rft-release.txt``, pip's
``--require-hashes``), is unpacked by PyPA's ``wheel``; ``patches/series`` is applied to it with
``git apply``, every module under ``trinity/`` is copied in, and ``wheel pack`` writes it again
with the local version ``bapo.<digest>`` and a RECORD of its own. The digest is taken over the
series and the modules, so that any edit gives a new label; PEP 440 ignores the label where a
requirement says ``trinity-rft==0.6.0``. Each failure is one line, and nothing is installed:
no wheel can be fetched, the fetched wheel's hash is not the pinned one, a patch does not apply,
or pip refuses the target (a Python outside the release's range, say).

Run: python -m scripts.make_wheel [--install PYTHON ...]: build the wheel into dist/ (if it is
not there yet), then make each PYTHON's environment hold that version (a no-op where it does).
"""

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

from scripts.make_pr import git

REPO = Path(__file__).resolve().parents[1]
RELEASE = "0.6.0"
PIN = "trinity-rft-release.txt"  # the released wheel's requirement line, with its sha256
DOWNLOADS = REPO / "build" / "wheel"


def sources(root: Path = REPO) -> List[Path]:
    """The files the wheel adds to the release: the series' patches in order, then our modules."""
    patches = [
        root / "patches" / name for name in (root / "patches" / "series").read_text().split()
    ]
    modules = sorted(p for p in (root / "trinity").rglob("*.py") if "__pycache__" not in p.parts)
    return patches + modules


def label(root: Path = REPO) -> str:
    """The local version: ``bapo.`` and a digest of the sources' paths and bytes."""
    digest = hashlib.sha256()
    for path in sources(root):
        digest.update(f"{path.relative_to(root)}\0".encode() + path.read_bytes() + b"\0")
    return f"bapo.{digest.hexdigest()[:8]}"


def wheel_name(root: Path = REPO) -> str:
    """The file name ``wheel pack`` gives the patched wheel."""
    return f"trinity_rft-{RELEASE}+{label(root)}-py3-none-any.whl"


def pip_error(stderr: str) -> str:
    """Return pip's own reason in one line: its last ``ERROR:`` line, or its last line."""
    errors = [line for line in stderr.splitlines() if line.startswith("ERROR:")]
    return (errors or stderr.strip().splitlines() or ["no output"])[-1].removeprefix("ERROR: ")


def release_wheel(root: Path = REPO, downloads: Path = DOWNLOADS) -> Path:
    """The released wheel, downloaded by pip (or found in ``downloads``) and its hash checked."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    pip += ["--require-hashes", "-r", str(root / PIN), "-d", str(downloads)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        got = re.search(r"Got\s+([0-9a-f]{64})", done.stderr)
        if got:
            raise SystemExit(
                f"the trinity-rft {RELEASE} wheel pip fetched has sha256 {got.group(1)}, not the "
                f"one pinned in {PIN}: refused"
            )
        raise SystemExit(f"cannot fetch the trinity-rft {RELEASE} wheel: {pip_error(done.stderr)}")
    return downloads / f"trinity_rft-{RELEASE}-py3-none-any.whl"


def apply_series(tree: Path, root: Path = REPO) -> None:
    """Apply each patch of the series to the unpacked release, or exit naming patch and file."""
    for patch in sources(root):
        if patch.suffix != ".patch":
            continue
        try:
            git(tree, "apply", str(patch))
        except subprocess.CalledProcessError as err:
            where = re.search(r"error: (?:patch failed: )?([^:\s]+)", err.stderr)
            raise SystemExit(
                f"patches/{patch.name} does not apply to {where.group(1) if where else '?'} of "
                f"trinity-rft {RELEASE}: {err.stderr.strip().splitlines()[-1]}"
            ) from None


def build(dist: Path = REPO / "dist", root: Path = REPO, downloads: Path = DOWNLOADS) -> Path:
    """Write the patched wheel into ``dist`` (removing older ones of ours there); its path."""
    release = release_wheel(root, downloads)
    wheel = [sys.executable, "-m", "wheel"]
    with tempfile.TemporaryDirectory(prefix="trinity-wheel-") as tmp:
        subprocess.run([*wheel, "unpack", str(release), "-d", tmp], check=True, capture_output=True)
        tree = Path(tmp) / f"trinity_rft-{RELEASE}"
        apply_series(tree, root)
        for module in sources(root):
            if module.suffix == ".py":
                shutil.copyfile(module, tree / module.relative_to(root))
        packed = Path(tmp) / "packed"
        packed.mkdir()
        pack = [*wheel, "pack", str(tree), "-d", str(packed), "--local-version", label(root)]
        subprocess.run(pack, check=True, capture_output=True)
        dist.mkdir(parents=True, exist_ok=True)
        target = dist / wheel_name(root)
        shutil.move(packed / target.name, target)
    for older in set(dist.glob(f"trinity_rft-{RELEASE}+bapo.*.whl")) - {target}:
        older.unlink()
    return target


def installed_version(python: str) -> Optional[str]:
    """The trinity-rft version ``python``'s environment holds, or None."""
    code = "import importlib.metadata as m; print(m.version('trinity-rft'))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return done.stdout.strip() if done.returncode == 0 else None


def install(python: str, wheel: Path) -> None:
    """Install ``wheel`` (no dependencies) with ``python``'s pip, or exit with pip's reason."""
    pip = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", str(wheel)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(
            f"pip did not install {wheel.name} into {python}: {pip_error(done.stderr)}"
        )


def main(argv=None) -> int:
    """Build the wheel where dist/ lacks it; bring each ``--install`` Python to its version."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", nargs="*", default=[], metavar="PYTHON")
    args = parser.parse_args(argv)
    version = f"{RELEASE}+{label()}"
    wheel = REPO / "dist" / wheel_name()
    targets = [python for python in args.install if installed_version(python) != version]
    if not wheel.is_file() and (targets or not args.install):
        wheel = build()
    print(f"{wheel.relative_to(REPO)}: trinity-rft {version}")
    for python in targets:
        install(python, wheel)
        print(f"installed trinity-rft {version} into {python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
