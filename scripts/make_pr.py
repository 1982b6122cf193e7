"""Write the pull requests, one git patch each against the Trinity-RFT 0.6.0 source distribution.

``dist/trinity-rft-policy-loss-runtime-keys.patch``: the interface (``patches/runtime-keys-*``
and its test); ``dist/trinity-rft-bapo.patch``: BAPO (``patches/bapo-*``, our modules, the
examples, its tests), on top of the interface; ``dist/trinity-rft-loss-agg-mode.patch``: the
config fix and its test, alone; ``dist/trinity-rft-bapo-update-scope.patch``: the pass over each
optimizer update (``patches/update-scope-*`` and its test), on top of BAPO. Each is one
commit, as ``git format-patch`` writes it, on its base tree (the unpacked sdist, from PyPI,
cached in build/sdist/, with its bases' commits): its patches applied and its files added,
with its description (``patches/pr/<name>.md``) as the message. ``git am -3`` and ``git apply``
both take it.
Run: make pr (or: python -m scripts.make_pr [OUTPUT_DIR])
"""

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches"
OUTPUT = REPO / "dist"
SDIST = REPO / "build" / "sdist" / "trinity_rft-0.6.0.tar.gz"
# the commits' author and date, fixed so that a rerun writes the same bytes; `git am` keeps them
AUTHOR = ["-c", "user.name=Trinity-RFT contributor", "-c", "user.email=contributor@example.com"]
DATES = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}


@dataclass(frozen=True)
class PullRequest:
    """The patches (in order) and the repo files one pull request holds, and what it builds on."""

    name: str
    patches: List[str]
    files: List[str]
    base: Optional["PullRequest"] = None

    def description(self) -> str:
        """The commit message: the description, then the parts the patch holds, one line each."""
        subjects = [(PATCHES / p).read_text().splitlines()[0] for p in self.patches]
        parts = "".join(f"- {line.split('] ', 1)[1]}\n" for line in subjects)
        head = (PATCHES / "pr" / f"{self.name}.md").read_text().strip()
        return f"{head}\n\nChanges to existing files:\n{parts}"


def _files(name: str) -> List[str]:
    """The repo files a pull request adds: ``patches/pr/<name>.files`` lists files and folders."""
    listed = (PATCHES / "pr" / f"{name}.files").read_text().split()
    found = [p for f in listed for p in [REPO / f, *(REPO / f).rglob("*")] if p.is_file()]
    return sorted(str(p.relative_to(REPO)) for p in found if "__pycache__" not in p.parts)


def _pull_request(name: str, prefix: str, base: Optional[PullRequest] = None) -> PullRequest:
    """The pull request ``name``: the patches ``<prefix>-NNNN-*.patch`` in order, its files."""
    patches = sorted(p.name for p in PATCHES.glob(f"{prefix}-[0-9]*.patch"))
    return PullRequest(name, patches, _files(name), base)


def pull_requests() -> List[PullRequest]:
    """The interface, BAPO on top of it, the config fix, and BAPO's pair per update on BAPO."""
    keys = _pull_request("policy-loss-runtime-keys", "runtime-keys")
    bapo = _pull_request("bapo", "bapo", base=keys)
    update = _pull_request("bapo-update-scope", "update-scope", base=bapo)
    return [keys, bapo, _pull_request("loss-agg-mode", "loss-agg-mode"), update]


def source_distribution() -> Path:
    """The trinity-rft 0.6.0 sdist, downloaded once; raises RuntimeError if it cannot be had."""
    if not SDIST.is_file():
        SDIST.parent.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        pip += ["trinity-rft==0.6.0", "-d", str(SDIST.parent)]
        done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not SDIST.is_file():
            raise RuntimeError(f"cannot download the trinity-rft 0.6.0 sdist:\n{done.stderr}")
    return SDIST


def unpack(into: Path) -> Path:
    """Unpack the sdist under ``into``; return its root."""
    with tarfile.open(source_distribution()) as archive:
        archive.extractall(into, filter="data")
    return into / "trinity_rft-0.6.0"


def git(root: Path, *args: str, stdin: Optional[str] = None) -> str:
    """Run git in ``root`` (never in an enclosing repository) and return its output."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent), **DATES}
    return subprocess.run(
        ["git", *args], cwd=root, env=env, input=stdin, capture_output=True, text=True, check=True
    ).stdout


def add(root: Path, pr: PullRequest) -> None:
    """Apply the pull request's patches to the tree at ``root`` and copy its files in."""
    git(root, "apply", *(str(PATCHES / p) for p in pr.patches))
    for rel in pr.files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, root / rel)


def format_patch(pr: PullRequest) -> str:
    """The pull request as ``git format-patch`` writes it: one commit on its base tree."""
    with tempfile.TemporaryDirectory(prefix="trinity-pr-") as tmp:
        root = unpack(Path(tmp))
        git(root, "init", "-q")
        chain = [pr]
        while chain[0].base:
            chain.insert(0, chain[0].base)  # type: ignore[arg-type]
        for step in [None, *chain]:
            message = "Trinity-RFT 0.6.0" if step is None else step.description()
            if step is not None:
                add(root, step)
            git(root, "add", "-A")
            git(root, *AUTHOR, "commit", "-q", "--cleanup=verbatim", "-F", "-", stdin=message)
        return git(root, "format-patch", "--stdout", "--no-renames", "--no-signature", "-1")


def main(output: Path = OUTPUT) -> int:
    """Write every pull request's patch into ``output``."""
    output.mkdir(parents=True, exist_ok=True)
    for pr in pull_requests():
        path = output / f"trinity-rft-{pr.name}.patch"
        path.write_text(format_patch(pr))
        print(f"wrote {path}: {len(pr.patches)} parts, {len(pr.files)} files added")
    return 0


if __name__ == "__main__":
    sys.exit(main(*map(Path, sys.argv[1:2])))
