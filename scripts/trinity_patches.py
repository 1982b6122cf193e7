#!/usr/bin/env python3
"""Apply, revert and show (status) this repo's changes to an installed trinity-rft.

patches/series is applied by ``git apply`` to copies that move into place together. A file is
released if its sha256 is RECORD's, patched if reverse-applying the series gives those bytes;
anything else is refused, by name. Each file is patched or reverted on its own, so a run killed
between two renames leaves a mix that the next run completes. Our ``trinity/*.py`` are copied in
(hashes in trinity/.bapo-installed.json); a copy edited in place or a file not ours is never
overwritten or removed. Temporary files (``.NAME.PID.tmp``) left by a killed run are removed.

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
import stat
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
    "modified": "edited since it was installed: neither `apply` nor `revert` replaces or removes "
    "it; move your change away, then rerun",
    "stray": "a temporary file of an interrupted run: the next `apply` or `revert` removes it",
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
    """Put copies of the sources at their targets, all or none, keeping a target's mode."""
    pending = []  # copies next to their targets, then renames (which cannot fail)
    try:
        for rel, src in sources.items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            tmp = (site / rel).with_name(f".{Path(rel).name}.{os.getpid()}.tmp")
            pending.append((tmp, site / rel))
            shutil.copyfile(src, tmp)
            exists = (site / rel).exists()
            os.chmod(tmp, stat.S_IMODE((site / rel).stat().st_mode) if exists else 0o644)
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


def pending(site: Path, released: dict[str, str], action: str) -> list[str]:
    """The files still to patch (or revert); refuse, naming files, unless each is one of both."""
    states = file_states(site, released)
    if set(states.values()) <= {"released", "patched"}:
        todo = {"apply": "released", "revert": "patched"}[action]
        return [rel for rel, state in states.items() if state == todo]
    lines = [f"refusing to {action}: a touched file is neither released nor patched"]
    for rel, state in states.items():
        lines.append(f"  {state:<9} {rel}")
        if state in ("modified", "missing"):
            digest = sha256(site / rel) if state == "modified" else "-"
            lines += [f"      sha256   {digest}", f"      released {released.get(rel, '-')}"]
    hint = f"To start clean: pip install --force-reinstall --no-deps {DIST}=={VERSION}"
    raise SystemExit("\n".join([*lines, hint]))


def rewrite(site: Path, released: dict[str, str], rels: list[str], reverse: bool) -> None:
    """Run the series on copies of `rels`; move the results into place only if all worked."""
    with tempfile.TemporaryDirectory(prefix="trinity-patches-") as tmp:
        root = stage(site, rels, tmp)
        only = [f"--include={rel}" for rel in rels]
        done = git_apply(root, *["-R"] * reverse, *only, *series()[:: -1 if reverse else 1])
        if done.returncode or (reverse and any(sha256(root / r) != released[r] for r in rels)):
            raise SystemExit(f"the series did not apply to copies:\n{done.stderr.decode()}")
        place(site, {rel: root / rel for rel in rels})


def repo_modules(overlay: Path) -> dict[str, Path]:
    """Site-relative path -> source of every module under the repo's `trinity/`."""
    found = sorted(p for p in overlay.rglob("*.py") if "__pycache__" not in p.parts)
    return {str(src.relative_to(overlay.parent)): src for src in found}


def module_states(site: Path, overlay: Path, released: dict[str, str]) -> dict[str, str]:
    """Map each repo module and recorded copy to its state; see `clashes`.

    A recorded copy is installed, outdated (the recorded bytes), stale (recorded bytes, no
    longer in the repo) or modified; a file the record lacks is unrecorded (the repo's bytes:
    ours) or foreign; a path pip installed is blocked.
    """
    record, sources, states = read_record(site), repo_modules(overlay), {}
    for rel in sorted(set(sources) | set(record)):
        src, dst, state = sources.get(rel), site / rel, "absent"
        if rel in released:
            state = "blocked"
        elif dst.exists() and rel in record:
            digest = sha256(dst)
            if src and digest == sha256(src):
                state = "installed"
            elif digest == record[rel]:
                state = "outdated" if src else "stale"
            else:
                state = "modified"
        elif dst.exists() and src:
            state = "unrecorded" if sha256(dst) == sha256(src) else "foreign"
        states[rel] = state
    return states


def clashes(states: dict[str, str], wanted: set[str]) -> dict[str, str]:
    """Files the run must not touch: edited copies, or what is not ours where ours would go."""
    return {
        rel: state
        for rel, state in states.items()
        if state == "modified" or (rel in wanted and state in ("blocked", "foreign"))
    }


def strays(site: Path, rels: list[str]) -> list[str]:
    """Temporary files ``.NAME.PID.tmp`` that a killed run left beside the files `rels`."""
    found = set()
    for rel in [*rels, RECORD]:
        name = Path(rel).name
        for path in (site / rel).parent.glob(f".{name}.*.tmp"):
            if re.fullmatch(rf"\.{re.escape(name)}\.\d+\.tmp", path.name):
                found.add(str(path.relative_to(site)))
    return sorted(found)


def foreign(site: Path, released: dict[str, str], rels: list[str]) -> list[str]:
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


def write_record(site: Path, record: dict[str, str]) -> None:
    """Replace our record of installed modules in one rename, as ``place`` does."""
    with tempfile.TemporaryDirectory(prefix="trinity-patches-") as tmp:
        Path(tmp, "record.json").write_text(json.dumps(record, indent=1, sort_keys=True))
        place(site, {RECORD: Path(tmp, "record.json")})


def cmd_apply(site: Path, overlay: Path, reverse: bool) -> None:
    """Patch or revert (finishing what a killed run left), then install or remove our modules."""
    released, action = released_hashes(site), "revert" if reverse else "apply"
    todo = pending(site, released, action)
    states = module_states(site, overlay, released)
    wanted = set() if reverse else set(repo_modules(overlay))
    refused = clashes(states, wanted)
    if refused:
        lines = [f"refusing to {action}: these files are not ours to replace or remove:"]
        raise SystemExit("\n".join([*lines, *listing(refused)]))
    for rel in strays(site, [*touched(), *states]):  # under the lock: no run is writing them
        (site / rel).unlink()
    if todo:
        rewrite(site, released, todo, reverse)
    done = [patch for patch in series() if set(touched([patch])) & set(todo)]
    print(f"{len(done)} of {len(series())} patches {'reverted' if reverse else 'applied'} now")
    before = read_record(site)
    ours = set(before) | {rel for rel, state in states.items() if state == "unrecorded"}
    removed = sorted(ours - wanted - set(released))  # never a file pip installed
    remove_modules(site, removed)
    copies = {rel: overlay.parent / rel for rel in wanted if states[rel] in ("absent", "outdated")}
    place(site, copies)
    record = {rel: sha256(site / rel) for rel in wanted}
    if record and record != before:
        write_record(site, record)
    elif not record:
        (site / RECORD).unlink(missing_ok=True)
    if reverse:
        left = {rel: "foreign" for rel in foreign(site, released, list(states))}
        print("\n".join([f"our modules: {len(removed)} removed", *listing(left)]))
    else:
        print(f"our modules: {len(wanted)} installed, {len(copies)} of them copied now")


def cmd_status(site: Path, overlay: Path) -> bool:
    """Print the state of every touched file and module; True when all is as the repo has it."""
    released = released_hashes(site)
    files, modules = file_states(site, released), module_states(site, overlay, released)
    others = {
        rel: "foreign" for rel in foreign(site, released, list(modules)) if rel not in modules
    }
    left = {rel: "stray" for rel in strays(site, [*files, *modules])}
    print(f"{DIST} {VERSION} in {site}")
    for kind, states in (("touched files", files), ("our modules", modules | others)):
        print("\n".join([f"{kind}:", *listing(states)]))
    if left:
        print("\n".join(["left by an interrupted run:", *listing(left)]))
    return set(files.values()) == {"patched"} and set(modules.values()) <= {"installed"}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line (see the module docstring) and run one command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("apply", "revert", "status"))
    parser.add_argument("--site", type=Path, help="directory that holds the trinity package")
    parser.add_argument("--overlay", type=Path, default=REPO / "trinity", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    site = (args.site or Path(str(importlib.metadata.distribution(DIST).locate_file("")))).resolve()
    try:
        if args.command != "status":
            with locked(site):
                cmd_apply(site, args.overlay.resolve(), reverse=args.command == "revert")
        elif not cmd_status(site, args.overlay.resolve()):
            return 1  # not everything is patched and installed as the repo has it
    except OSError as error:  # a read-only site, say: what failed where, in one line
        if error.filename is None:
            raise
        where = Path(error.filename).parent
        raise SystemExit(f"cannot {args.command} in {where}: {error.strerror}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
