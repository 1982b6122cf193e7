#!/usr/bin/env python3
"""Apply, revert and show (status) this repo's changes to an installed trinity-rft.

patches/series is applied by ``git apply`` to copies that move into place together. A file is
released if its sha256 is RECORD's, patched if reverse-applying the series gives those bytes;
anything else is refused, by name. Our ``trinity/*.py`` are copied in (hashes in
trinity/.bapo-installed.json), never over a copy edited in place or a file not ours.
"""

import argparse
import base64
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DIST, VERSION = "trinity-rft", "0.6.0"
RECORD = "trinity/.bapo-installed.json"


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, on which every state check rests."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def series() -> list[Path]:
    """The patches in application order."""
    return [REPO / "patches" / name for name in (REPO / "patches" / "series").read_text().split()]


def touched(patches: list[Path] | None = None) -> list[str]:
    """Site-relative paths the given patches (by default the series) change."""
    text = "".join(p.read_text() for p in series() if patches is None or p in patches)
    return sorted(set(re.findall(r"^\+\+\+ b/(\S+)", text, re.M)))


def released_hashes(site: Path) -> dict[str, str]:
    """Hex sha256 of every released file, from RECORD, after checking the installed version."""
    dists = list(importlib.metadata.distributions(name=DIST, path=[str(site)]))
    if len(dists) != 1:
        raise SystemExit(f"{len(dists)} {DIST} installations found in {site}; expected one")
    if dists[0].version != VERSION:
        raise SystemExit(f"{DIST} {dists[0].version} is installed; the series is for {VERSION}")
    hashes = {str(f): f.hash for f in dists[0].files or [] if f.hash and f.hash.mode == "sha256"}
    return {rel: base64.urlsafe_b64decode(h.value + "==").hex() for rel, h in hashes.items()}


def git_apply(root: Path, *args: str | Path) -> subprocess.CompletedProcess[bytes]:
    """``git apply`` on the plain directory `root`, never inside an enclosing repository."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
    return subprocess.run(["git", "apply", *args], cwd=root, env=env, capture_output=True)


def stage(site: Path, rels: list[str], tmp: str) -> Path:
    """Copy files of `site` into a scratch tree, where the series is tried first."""
    for rel in rels:
        Path(tmp, rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site / rel, Path(tmp, rel))
    return Path(tmp)


def place(site: Path, sources: dict[str, Path]) -> dict[str, str]:
    """Put copies of the sources at their targets, all or none; return the copies' hashes."""
    pending, hashes = [], {}  # copies next to their targets, then renames (which cannot fail)
    try:
        for rel, src in sources.items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            tmp = (site / rel).with_name(f".{src.name}.{os.getpid()}.tmp")
            pending.append((tmp, site / rel))
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o644)
            hashes[rel] = sha256(tmp)
    except BaseException:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, dst in pending:
        os.replace(tmp, dst)  # a fresh mtime, so no cached bytecode of the old copy matches
    return hashes


def file_states(site: Path, released: dict[str, str]) -> dict[str, str]:
    """'released', 'patched', 'modified' or 'missing' for every file the series touches."""
    rels, states = touched(), {}
    with tempfile.TemporaryDirectory(prefix="trinity-patches-") as tmp:
        root = stage(site, [rel for rel in rels if (site / rel).is_file()], tmp)
        for rel in rels:
            if (site / rel).is_file() and sha256(site / rel) == released.get(rel):
                states[rel] = "released"
            elif (site / rel).is_file():
                undone = git_apply(root, "-R", f"--include={rel}", *series()[::-1]).returncode
                same = not undone and sha256(root / rel) == released.get(rel)
                states[rel] = "patched" if same else "modified"
            else:
                states[rel] = "missing"
    return states


def pending(site: Path, released: dict[str, str], action: str) -> list[Path]:
    """The patches still to apply (or revert); refuse, naming files, unless each is whole."""
    states = file_states(site, released)
    per_patch = [{states[rel] for rel in touched([patch])} for patch in series()]
    if all(kinds in ({"released"}, {"patched"}) for kinds in per_patch):
        todo = {"apply": "released", "revert": "patched"}[action]
        return [patch for patch, kinds in zip(series(), per_patch) if todo in kinds]
    lines = [f"refusing to {action}: not every patch is wholly applied or not applied at all"]
    for rel, state in states.items():
        lines.append(f"  {state:<9} {rel}")
        if state in ("modified", "missing"):
            digest = sha256(site / rel) if state == "modified" else "-"
            lines += [f"      sha256   {digest}", f"      released {released.get(rel, '-')}"]
    hint = f"To start clean: pip install --force-reinstall --no-deps {DIST}=={VERSION}"
    raise SystemExit("\n".join([*lines, hint]))


def rewrite(site: Path, released: dict[str, str], patches: list[Path], reverse: bool) -> None:
    """Run the patches on copies and move the results into place only if they all worked."""
    rels = touched(patches)
    with tempfile.TemporaryDirectory(prefix="trinity-patches-") as tmp:
        root = stage(site, rels, tmp)
        done = git_apply(root, *["-R"] * reverse, *(patches[::-1] if reverse else patches))
        if done.returncode or (reverse and any(sha256(root / r) != released[r] for r in rels)):
            raise SystemExit(f"the series did not apply to copies:\n{done.stderr.decode()}")
        place(site, {rel: root / rel for rel in rels})


def module_states(site: Path, overlay: Path) -> dict[str, str]:
    """Map each repo module to installed, outdated, absent, modified or blocked (not ours)."""
    record, states = read_record(site), {}
    for src in sorted(p for p in overlay.rglob("*.py") if "__pycache__" not in p.parts):
        rel = str(src.relative_to(overlay.parent))
        dst, state = site / rel, "absent"
        if dst.exists():
            digest, wanted = sha256(dst), sha256(src)
            state = "installed" if digest == wanted else "outdated"
            state = "modified" if digest not in (record.get(rel), wanted) else state
            state = state if rel in record else "blocked"
        states[rel] = state
    return states


def read_record(site: Path) -> dict[str, str]:
    """Our installed modules: site-relative path -> sha256 of the copy."""
    return json.loads((site / RECORD).read_text()) if (site / RECORD).is_file() else {}


def remove_modules(site: Path, rels: list[str]) -> None:
    """Remove our modules, their bytecode, and directories left empty (pip makes none empty)."""
    for rel in rels:
        (site / rel).unlink(missing_ok=True)
        for pyc in (site / rel).parent.glob(f"__pycache__/{Path(rel).stem}.*.pyc"):
            pyc.unlink()
        for directory in Path(rel).parents[:-2]:
            for sub in (site / directory / "__pycache__", site / directory):
                if sub.is_dir() and not any(sub.iterdir()):
                    sub.rmdir()


def cmd_apply(site: Path, overlay: Path, reverse: bool) -> None:
    """Patch or revert (unless done already), then install or remove our modules."""
    released = released_hashes(site)
    todo = pending(site, released, "revert" if reverse else "apply")
    modules = {} if reverse else module_states(site, overlay)
    clashes = [f"  {rel} ({s})" for rel, s in modules.items() if s in ("modified", "blocked")]
    if clashes:
        raise SystemExit("refusing to install our modules over these files:\n" + "\n".join(clashes))
    if todo:
        rewrite(site, released, todo, reverse)
    print(f"{len(todo)} of {len(series())} patches {'reverted' if reverse else 'applied'} now")
    before = read_record(site)
    remove_modules(site, [rel for rel in before if rel not in modules])
    copies = {rel: overlay.parent / rel for rel, state in modules.items() if state != "installed"}
    record = {rel: h for rel, h in before.items() if rel in modules} | place(site, copies)
    if record and record != before:
        tmp = Path(f"{site / RECORD}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, site / RECORD)
    elif not record:
        (site / RECORD).unlink(missing_ok=True)
    print(f"our modules: {len(modules)} installed, {len(copies)} of them copied now")


def cmd_status(site: Path, overlay: Path) -> bool:
    """Print the state of every touched file and module; True when all is as the repo has it."""
    files, modules = file_states(site, released_hashes(site)), module_states(site, overlay)
    modules |= {rel: "stale" for rel in read_record(site) if rel not in modules}
    print(f"{DIST} {VERSION} in {site}")
    for kind, states in (("touched files", files), ("our modules", modules)):
        print(f"{kind}:\n" + "\n".join(f"  {state:<9} {rel}" for rel, state in states.items()))
    return set(files.values()) == {"patched"} and set(modules.values()) <= {"installed"}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line (see the module docstring) and run one command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("apply", "revert", "status"))
    parser.add_argument("--site", type=Path, help="directory that holds the trinity package")
    parser.add_argument("--overlay", type=Path, default=REPO / "trinity", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    site = args.site or Path(str(importlib.metadata.distribution(DIST).locate_file("")))
    if args.command != "status":
        cmd_apply(site.resolve(), args.overlay.resolve(), reverse=args.command == "revert")
    elif not cmd_status(site.resolve(), args.overlay.resolve()):
        return 1  # not everything is patched and installed as the repo has it
    return 0


if __name__ == "__main__":
    sys.exit(main())
