#!/usr/bin/env python3
"""Apply, revert and show (status) this repo's changes to an installed trinity-rft.

patches/series is applied by ``git apply`` to copies that move into place together. A file is
released if its sha256 is RECORD's, patched if reverse-applying the series gives those bytes;
anything else is refused, by name. Our ``trinity/*.py`` are copied in (hashes in
trinity/.bapo-installed.json), never over a copy edited in place or a file not ours.

A file at one of our module paths is ours when that record lists it or, failing that, when pip's
RECORD does not and its bytes are the repo's module (``apply`` records it, ``revert`` removes it).
Other files pip did not install are left alone; ``status`` calls those at or beside our module
paths (older copies of ours, say) foreign. ``apply`` and ``revert`` take turns, by an flock.
"""

import argparse
import base64
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DIST, VERSION = "trinity-rft", "0.6.0"
RECORD = "trinity/.bapo-installed.json"
NOTES = {
    "unrecorded": "a copy of ours missing from the record: `apply` records it, `revert` removes it",
    "foreign": "neither pip's nor ours: `apply` will not replace it and `revert` leaves it; "
    "remove it by hand if it is an older copy of ours",
}


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


def place(site: Path, sources: dict[str, Path]) -> None:
    """Put copies of the sources at their targets, all or none."""
    pending = []  # copies next to their targets, then renames (which cannot fail)
    try:
        for rel, src in sources.items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            tmp = (site / rel).with_name(f".{src.name}.{os.getpid()}.tmp")
            pending.append((tmp, site / rel))
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o644)
    except BaseException:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, dst in pending:
        os.replace(tmp, dst)  # a fresh mtime, so no cached bytecode of the old copy matches


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


def module_states(site: Path, overlay: Path, released: dict[str, str]) -> dict[str, str]:
    """Map each repo module to its state; `apply` replaces none modified, blocked or foreign.

    A recorded copy is installed, outdated (the recorded bytes) or modified; a file the record
    lacks is unrecorded (the repo's bytes: ours) or foreign; a path pip installed is blocked.
    """
    record, states = read_record(site), {}
    for src in sorted(p for p in overlay.rglob("*.py") if "__pycache__" not in p.parts):
        rel = str(src.relative_to(overlay.parent))
        dst, state = site / rel, "absent"
        if rel in released:
            state = "blocked"
        elif dst.exists() and rel in record:
            digest, wanted = sha256(dst), sha256(src)
            state = "installed" if digest == wanted else "outdated"
            state = state if digest in (wanted, record[rel]) else "modified"
        elif dst.exists():
            state = "unrecorded" if sha256(dst) == sha256(src) else "foreign"
        states[rel] = state
    return states


def strays(site: Path, released: dict[str, str], rels: list[str]) -> list[str]:
    """Files ``*.py`` beside the modules `rels` that neither pip's RECORD nor our record lists."""
    found = {str(p.relative_to(site)) for rel in rels for p in (site / rel).parent.glob("*.py")}
    return sorted(found - set(released) - set(read_record(site)))


def listing(states: dict[str, str]) -> list[str]:
    """One line per file, then what the states that need a word mean, for the user to act on."""
    lines = [f"  {state:<9} {rel}" for rel, state in states.items()]
    return lines + [f"{s}: {NOTES[s]}" for s in sorted(set(states.values()) & set(NOTES))]


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


@contextlib.contextmanager
def locked(site: Path) -> Iterator[None]:
    """Hold an exclusive flock on `site`: a concurrent run waits, then finds the work done."""
    handle = os.open(site, os.O_RDONLY)  # the directory itself, so no lock file is left behind
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # frees the lock, as the end of the process would


def cmd_apply(site: Path, overlay: Path, reverse: bool) -> None:
    """Patch or revert (unless done already), then install or remove our modules."""
    released = released_hashes(site)
    todo = pending(site, released, "revert" if reverse else "apply")
    states = module_states(site, overlay, released)
    wanted = {} if reverse else states
    clashes = {rel: s for rel, s in wanted.items() if s in ("modified", "blocked", "foreign")}
    if clashes:
        lines = ["refusing to install our modules over these files:", *listing(clashes)]
        raise SystemExit("\n".join(lines))
    if todo:
        rewrite(site, released, todo, reverse)
    print(f"{len(todo)} of {len(series())} patches {'reverted' if reverse else 'applied'} now")
    before = read_record(site)
    ours = set(before) | {rel for rel, state in states.items() if state == "unrecorded"}
    removed = sorted(ours - set(wanted) - set(released))  # never a file pip installed
    remove_modules(site, removed)
    copies = {rel: overlay.parent / rel for rel, s in wanted.items() if s in ("absent", "outdated")}
    place(site, copies)
    record = {rel: sha256(site / rel) for rel in wanted}
    if record and record != before:
        tmp = Path(f"{site / RECORD}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, site / RECORD)
    elif not record:
        (site / RECORD).unlink(missing_ok=True)
    if reverse:
        left = {rel: "foreign" for rel in strays(site, released, list(states))}
        print("\n".join([f"our modules: {len(removed)} removed", *listing(left)]))
    else:
        print(f"our modules: {len(wanted)} installed, {len(copies)} of them copied now")


def cmd_status(site: Path, overlay: Path) -> bool:
    """Print the state of every touched file and module; True when all is as the repo has it."""
    released = released_hashes(site)
    files, modules = file_states(site, released), module_states(site, overlay, released)
    modules |= {rel: "stale" for rel in read_record(site) if rel not in modules}
    others = {rel: "foreign" for rel in strays(site, released, list(modules)) if rel not in modules}
    print(f"{DIST} {VERSION} in {site}")
    for kind, states in (("touched files", files), ("our modules", modules | others)):
        print("\n".join([f"{kind}:", *listing(states)]))
    return set(files.values()) == {"patched"} and set(modules.values()) <= {"installed"}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line (see the module docstring) and run one command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("apply", "revert", "status"))
    parser.add_argument("--site", type=Path, help="directory that holds the trinity package")
    parser.add_argument("--overlay", type=Path, default=REPO / "trinity", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    site = (args.site or Path(str(importlib.metadata.distribution(DIST).locate_file("")))).resolve()
    if args.command != "status":
        with locked(site):
            cmd_apply(site, args.overlay.resolve(), reverse=args.command == "revert")
    elif not cmd_status(site, args.overlay.resolve()):
        return 1  # not everything is patched and installed as the repo has it
    return 0


if __name__ == "__main__":
    sys.exit(main())
