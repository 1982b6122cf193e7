"""Write the pull requests, one git patch each against the Trinity-RFT 0.6.0 source distribution.

``dist/trinity-rft-policy-loss-runtime-keys.patch``: the interface (``patches/runtime-keys-*``
and its test); ``dist/trinity-rft-bapo.patch``: BAPO (``patches/bapo-*``, our modules, the
examples, its tests), on top of the interface; ``dist/trinity-rft-loss-agg-mode.patch``: the
config fix and its test, alone; ``dist/trinity-rft-bapo-update-scope.patch``: the pass over each
optimizer update (``patches/update-scope-*``, the module's ``search_scope`` and its test), on
top of BAPO. Each is one commit, as ``git format-patch`` writes it, on its base tree (the
unpacked sdist, from PyPI, cached in build/sdist/, with its bases' commits): its patches applied
and its files added, with its description (``patches/pr/<name>.md``) as the message. The diffs
of files the sdist lacks (README_zh.md, the Sphinx pages) are the parts' own, written against
the repository: ``git am -3`` takes each patch there, and ``git apply`` takes it on the sdist
with those files excluded. ``patches/pr/bapo-update-scope.module.patch`` takes the module's
``search_scope`` out of the BAPO pull request (applied in reverse there) and into the fourth.
Run: make pr (or: python -m scripts.make_pr [OUTPUT_DIR])
"""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches"
OUTPUT = REPO / "dist"
SDIST = REPO / "build" / "sdist" / "trinity_rft-0.6.0.tar.gz"
# the commits' author and date, fixed so that a rerun writes the same bytes; `git am` keeps them
AUTHOR = ["-c", "user.name=Trinity-RFT contributor", "-c", "user.email=contributor@example.com"]
DATES = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
# the module's search_scope, from the BAPO pull request's version to the repository's
MODULE_SPLIT = "bapo-update-scope.module.patch"


@dataclass(frozen=True)
class PullRequest:
    """The patches (in order) and the repo files one pull request holds, and what it builds on."""

    name: str
    patches: List[str]
    files: List[str]
    base: Optional["PullRequest"] = None
    held_back: Optional[str] = None  # a diff of its files (patches/pr/) that a later PR adds
    adds: Optional[str] = None  # a diff of its base's files (patches/pr/) that it applies

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
    bapo = replace(_pull_request("bapo", "bapo", base=keys), held_back=MODULE_SPLIT)
    update = replace(
        _pull_request("bapo-update-scope", "update-scope", base=bapo), adds=MODULE_SPLIT
    )
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


def file_diffs(text: str) -> Dict[str, str]:
    """The ``diff --git`` sections of a patch, by path."""
    sections = re.split(r"(?m)^(?=diff --git )", text)[1:]
    return {re.match(r"diff --git a/(\S+)", s).group(1): s for s in sections}  # type: ignore


def repository_only(root: Path, pr: PullRequest) -> Dict[str, str]:
    """The pull request's diffs of files the sdist leaves out (README_zh.md, docs/), by path.

    They are written against the repository's files (their blob ids included), so that
    ``git am -3`` can fall back on a three-way merge there; the patch carries them as they are.
    """
    diffs = [file_diffs((PATCHES / p).read_text()) for p in pr.patches]
    return {rel: diff for d in diffs for rel, diff in d.items() if not (root / rel).exists()}


def stand_in(root: Path, rel: str, diff: str) -> None:
    """Write the part of a left-out file that ``diff`` shows, so that git counts its lines."""
    shown = re.findall(r"^[ -](.*\n)", diff.split("\n@@", 1)[1], re.M)
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text("".join(shown))


def add(root: Path, pr: PullRequest) -> None:
    """Apply the pull request's patches to the tree at ``root`` and copy its files in."""
    git(root, "apply", *(str(PATCHES / p) for p in pr.patches))
    for rel in pr.files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, root / rel)
    if pr.held_back:
        git(root, "apply", "-R", str(PATCHES / "pr" / pr.held_back))
    if pr.adds:
        git(root, "apply", str(PATCHES / "pr" / pr.adds))


def format_patch(pr: PullRequest) -> str:
    """The pull request as ``git format-patch`` writes it: one commit on its base tree.

    A file the sdist leaves out gets a stand-in (for its bases' parts too), whose diff the pull
    request's own replaces.
    """
    chain = [pr]
    while chain[0].base:
        chain.insert(0, chain[0].base)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory(prefix="trinity-pr-") as tmp:
        root = unpack(Path(tmp))
        left_out = [repository_only(root, step) for step in chain]
        for rel, diff in (item for diffs in left_out for item in diffs.items()):
            stand_in(root, rel, diff)
        git(root, "init", "-q")
        for step in [None, *chain]:
            message = "Trinity-RFT 0.6.0" if step is None else step.description()
            if step is not None:
                add(root, step)
            git(root, "add", "-A")
            git(root, *AUTHOR, "commit", "-q", "--cleanup=verbatim", "-F", "-", stdin=message)
        options = ["--no-renames", "--no-signature", "--full-index"]
        patch = git(root, "format-patch", "--stdout", *options, "-1")
    head = re.split(r"(?m)^(?=diff --git )", patch)[0]
    return head + "".join(left_out[-1].get(rel, diff) for rel, diff in file_diffs(patch).items())


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
