"""Write dist/trinity-rft-bapo.patch: all of BAPO as one git patch against Trinity-RFT 0.6.0.

The patch holds the series in patches/ and adds our modules under trinity/, the example under
examples/bapo_gsm8k/ and the unit test tests/algorithm/bapo_policy_loss_test.py. It is the diff
between two trees in a scratch git repository: the released files (rebuilt from the installed
trinity-rft by reverse-applying the series, checked against pip's RECORD) and the same files
with the series applied and ours added. A maintainer applies it at the root of a v0.6.0 checkout
with ``git apply``. Run: make pr (or: scripts/pr/make_patch.py [OUTPUT])
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trinity_patches as tool  # noqa: E402

REPO = tool.REPO
OUTPUT = REPO / "dist" / "trinity-rft-bapo.patch"
UNIT_TEST = "tests/algorithm/bapo_policy_loss_test.py"


def added_files() -> list[str]:
    """Repo-relative paths of everything the patch adds, as they lie in both trees."""
    modules = [p for p in (REPO / "trinity").rglob("*.py") if "__pycache__" not in p.parts]
    example = [p for p in (REPO / "examples" / "bapo_gsm8k").rglob("*") if p.is_file()]
    return sorted(str(p.relative_to(REPO)) for p in modules + example) + [UNIT_TEST]


def git(root: Path, *args: str) -> str:
    """Run git in the scratch repository and return its output."""
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True)
    return done.stdout


def released_tree(root: Path) -> None:
    """Fill `root` with the released versions of the files the series touches."""
    site = Path(str(tool.importlib.metadata.distribution(tool.DIST).locate_file(""))).resolve()
    released = tool.released_hashes(site)
    tool.stage(site, tool.touched(), str(root))
    applied = tool.pending(site, released, "revert")
    if applied:
        done = tool.git_apply(root, "-R", *applied[::-1])
        assert done.returncode == 0, done.stderr.decode()
    wrong = [rel for rel in tool.touched() if tool.sha256(root / rel) != released[rel]]
    assert not wrong, f"not the released files: {wrong}"


def description() -> str:
    """The text before the diff (git apply skips it): what the patch holds, per part."""
    parts = [p.read_text().split("\n--- a/", 1)[0].strip() for p in tool.series()]
    lines = [
        "BAPO (Balanced Policy Optimization with Adaptive Clipping, arXiv 2510.18927)",
        "for Trinity-RFT 0.6.0. Apply at the root of a v0.6.0 checkout: git apply <this file>",
        "",
        "Changes to existing files, one part each:",
        "",
        *(part.replace("Subject: ", "") + "\n" for part in parts),
        "New files:",
        *(f"  {rel}" for rel in added_files()),
        "",
        "",
    ]
    return "\n".join(lines)


def main(output: Path = OUTPUT) -> int:
    """Build both trees, diff them, write the patch (to the path given as argument, if any)."""
    with tempfile.TemporaryDirectory(prefix="trinity-pr-") as tmp:
        root = Path(tmp, "Trinity-RFT")
        root.mkdir()
        released_tree(root)
        git(root, "init", "-q")
        git(root, "add", "-A")
        base = git(root, "write-tree").strip()
        done = tool.git_apply(root, *tool.series())
        assert done.returncode == 0, done.stderr.decode()
        for rel in added_files():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / rel, root / rel)
        git(root, "add", "-A")
        head = git(root, "write-tree").strip()
        prefixes = ["--src-prefix=a/", "--dst-prefix=b/", "--no-renames", "--no-ext-diff"]
        diff = git(root, "diff", "--no-color", *prefixes, base, head)
    output.parent.mkdir(exist_ok=True)
    output.write_text(description() + diff)
    counts = f"{len(tool.touched())} files changed, {len(added_files())} added"
    print(f"wrote {output}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*map(Path, sys.argv[1:2])))
