"""Write the pull requests, one git patch each against the Trinity-RFT 0.6.0 source distribution.

``dist/trinity-rft-policy-loss-runtime-keys.patch``: the interface (``patches/runtime-keys-*``
and its test); ``dist/trinity-rft-bapo.patch``: BAPO (``patches/bapo-*``, our modules, the
examples, its tests), on top of the interface; ``dist/trinity-rft-loss-agg-mode.patch``: the
config fix and its test, alone. Each is the diff from its base tree (the unpacked sdist, from
PyPI, cached in build/sdist/, with its base's changes) to the same tree with its patches applied
and its files added, after its description (``patches/pr/<name>.md``), which ``git apply`` skips.
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


@dataclass(frozen=True)
class PullRequest:
    """The patches (in order) and the repo files one pull request holds, and what it builds on."""

    name: str
    patches: List[str]
    files: List[str]
    base: Optional["PullRequest"] = None

    def description(self) -> str:
        """The text before the diff: the description, then the parts the patch holds."""
        parts = [(PATCHES / p).read_text().split("\n--- a/", 1)[0].strip() for p in self.patches]
        head = (PATCHES / "pr" / f"{self.name}.md").read_text().strip()
        changes = "".join(part.replace("Subject: ", "") + "\n\n" for part in parts)
        files = "".join(f"  {rel}\n" for rel in self.files)
        return (
            f"{head}\n\nChanges to existing files, one part each:\n\n{changes}New files:\n{files}\n"
        )


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
    """The three pull requests: the interface, BAPO on top of it, and the config fix."""
    keys = _pull_request("policy-loss-runtime-keys", "runtime-keys")
    bapo = _pull_request("bapo", "bapo", base=keys)
    return [keys, bapo, _pull_request("loss-agg-mode", "loss-agg-mode")]


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


def git(root: Path, *args: str) -> str:
    """Run git in ``root`` (never in an enclosing repository) and return its output."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    return subprocess.run(
        ["git", *args], cwd=root, env=env, capture_output=True, text=True, check=True
    ).stdout


def add(root: Path, pr: PullRequest) -> None:
    """Apply the pull request's patches to the tree at ``root`` and copy its files in."""
    git(root, "apply", *(str(PATCHES / p) for p in pr.patches))
    for rel in pr.files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, root / rel)


def diff(pr: PullRequest) -> str:
    """The pull request's diff against its base tree, made in a scratch git repository."""
    with tempfile.TemporaryDirectory(prefix="trinity-pr-") as tmp:
        root = unpack(Path(tmp))
        git(root, "init", "-q")
        if pr.base is not None:
            add(root, pr.base)
        git(root, "add", "-A")
        base = git(root, "write-tree").strip()
        add(root, pr)
        git(root, "add", "-A")
        head = git(root, "write-tree").strip()
        prefixes = ["--src-prefix=a/", "--dst-prefix=b/", "--no-renames", "--no-ext-diff"]
        return git(root, "diff", "--no-color", *prefixes, base, head)


def main(output: Path = OUTPUT) -> int:
    """Write every pull request's patch into ``output``."""
    output.mkdir(parents=True, exist_ok=True)
    for pr in pull_requests():
        path = output / f"trinity-rft-{pr.name}.patch"
        path.write_text(pr.description() + diff(pr))
        print(f"wrote {path}: {len(pr.patches)} parts, {len(pr.files)} files added")
    return 0


if __name__ == "__main__":
    sys.exit(main(*map(Path, sys.argv[1:2])))
