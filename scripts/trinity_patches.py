#!/usr/bin/env python3
"""Apply, revert and show (status) this repo's changes to an installed trinity-rft.

patches/series is applied by ``git apply`` to copies that move into place together. A file is
released if its sha256 is RECORD's, patched if reverse-applying the series gives those bytes,
outdated if reverse-applying a series of an earlier commit (read from git history) gives them:
``apply`` moves it to this series, ``revert`` to the release. Anything else is refused, by
name. Each file is patched or reverted on its own, so a run killed
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
    "outdated": "written by an earlier commit of this repository: `python "
    "scripts/trinity_patches.py apply` (or `make setup`) brings it to this one; `revert` "
    "restores the release",
}
SHALLOW = (
    "A file an earlier commit's series patched counts as modified where this checkout lacks that "
    "commit (an archive, a shallow clone: `git fetch --unshallow`)."
)
START_CLEAN = f"To start clean: pip install --force-reinstall --no-deps {DIST}=={VERSION}"


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, on which every state check rests."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def series() -> list[Path]:
    """The patches in application order."""
    return [REPO / "patches" / name for name in (REPO / "patches" / "series").read_text().split()]


def touched(patches: list[Path] | None = None) -> list[str]:
    """Site-relative paths the given patches (by default the series) change."""
    text = "".join(p.read_text() for p in (series() if patches is None else patches))
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


def stage(sources: dict[str, Path], tmp: Path) -> Path:
    """Copy the sources into a new scratch tree under `tmp`, where a series is tried first."""
    root = Path(tempfile.mkdtemp(dir=tmp))
    for rel, src in sources.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / rel)
    return root


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


def git_files(specs: list[str]) -> list[str | None]:
    """The repository's files ``commit:path``, read by one ``git cat-file``; None where absent."""
    asked = "".join(f"{spec}\n" for spec in specs).encode()
    done = subprocess.run(
        ["git", "cat-file", "--batch"], cwd=REPO, input=asked, capture_output=True
    )
    out, found, at = done.stdout, list[str | None](), 0
    for _ in specs if not done.returncode else ():
        end = out.index(b"\n", at)
        header = out[at:end].split()  # "<oid> blob <size>", or "<spec> missing"
        size = int(header[2]) if len(header) == 3 and header[1] == b"blob" else -1
        found.append(out[end + 1 : end + 1 + size].decode() if size >= 0 else None)
        at = end + 1 + (size + 1 if size >= 0 else 0)
    return found or [None] * len(specs)


def earlier_series(tmp: Path) -> list[list[Path]]:
    """Each other series the repository's git history holds, newest first, written under `tmp`.

    Empty where the checkout has no history (an archive); a shallow clone gives its own part.
    """
    paths = ["patches/series", ":(glob)patches/*.patch"]
    log = subprocess.run(["git", "log", "--format=%H", "--", *paths], cwd=REPO, capture_output=True)
    commits = log.stdout.decode().split()
    listing = dict(zip(commits, git_files([f"{c}:patches/series" for c in commits])))
    names = {commit: text.split() for commit, text in listing.items() if text}
    texts = iter(git_files([f"{c}:patches/{name}" for c in names for name in names[c]]))
    found, seen = [], {tuple[str | None, ...](p.read_text() for p in series())}
    for commit, its in names.items():
        patches = tuple(next(texts) for _ in its)
        if None in patches or patches in seen:
            continue
        seen.add(patches)
        (tmp / commit).mkdir()
        for name, text in zip(its, patches):
            (tmp / commit / name).write_text(text or "")
        found.append([tmp / commit / name for name in its])
    return found


def undo(site: Path, rel: str, want: str | None, patches: list[Path], tmp: Path) -> Path | None:
    """A scratch copy of `rel` with `patches` reversed, if that gives the released bytes."""
    root = stage({rel: site / rel}, tmp)
    done = git_apply(root, "-R", f"--include={rel}", *patches[::-1])
    return None if done.returncode or sha256(root / rel) != want else root / rel


def file_states(site: Path, released: dict[str, str], tmp: Path) -> tuple[dict, dict]:
    """The state of every file this series or an earlier one touches; released bytes if known.

    'released', 'patched' (this series' output), 'outdated' (an earlier series' output),
    'modified' (anything else) or 'missing'; the released bytes (a path) of the first three. A
    file that only an earlier series touched is listed unless it is released.
    """
    earlier, current = earlier_series(tmp), set(touched())
    states, copies = {}, {}
    for rel in sorted(current.union(*map(touched, earlier))):
        copy, want = None, released.get(rel)
        if not (site / rel).is_file():
            states[rel] = "missing"
        elif sha256(site / rel) == want:
            states[rel], copy = "released", site / rel
        elif rel in current and (copy := undo(site, rel, want, series(), tmp)):
            states[rel] = "patched"
        else:
            copy = next(filter(None, (undo(site, rel, want, p, tmp) for p in earlier)), None)
            states[rel] = "outdated" if copy else "modified"
        if copy:
            copies[rel] = copy
    return {rel: s for rel, s in states.items() if rel in current or s != "released"}, copies


def pending(site: Path, released: dict[str, str], action: str, tmp: Path) -> dict[str, Path]:
    """The files still to patch (or revert), with their released bytes.

    Refuses, naming files, unless each is released, patched or outdated.
    """
    states, copies = file_states(site, released, tmp)
    if set(states.values()) <= {"released", "patched", "outdated"}:
        todo = {"apply": "released", "revert": "patched"}[action]
        return {rel: copies[rel] for rel, state in states.items() if state in (todo, "outdated")}
    lines = [f"refusing to {action}: a touched file is neither released nor patched"]
    for rel, state in states.items():
        lines.append(f"  {state:<9} {rel}")
        if state in ("modified", "missing"):
            digest = sha256(site / rel) if state == "modified" else "-"
            lines += [f"      sha256   {digest}", f"      released {released.get(rel, '-')}"]
    raise SystemExit("\n".join([*lines, SHALLOW, START_CLEAN]))


def rewrite(site: Path, todo: dict[str, Path], reverse: bool, tmp: Path) -> None:
    """Put the released bytes of `todo` in place (revert), or the series run on them (apply).

    The series runs on copies, which move into place only if it applied to all.
    """
    root, only = stage(todo, tmp), [f"--include={rel}" for rel in todo if rel in touched()]
    if not reverse and only:  # a file only an earlier series touched goes back to the release
        done = git_apply(root, *only, *series())
        if done.returncode:
            raise SystemExit(f"the series did not apply to copies:\n{done.stderr.decode()}")
    place(site, {rel: root / rel for rel in todo})


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


def cmd_apply(site: Path, overlay: Path, reverse: bool, tmp: Path) -> None:
    """Patch or revert (finishing what a killed run left), then install or remove our modules."""
    released, action = released_hashes(site), "revert" if reverse else "apply"
    todo = pending(site, released, action, tmp)
    states = module_states(site, overlay, released)
    wanted = set() if reverse else set(repo_modules(overlay))
    refused = clashes(states, wanted)
    if refused:
        lines = [f"refusing to {action}: these files are not ours to replace or remove:"]
        raise SystemExit("\n".join([*lines, *listing(refused)]))
    for rel in strays(site, [*touched(), *states]):  # under the lock: no run is writing them
        (site / rel).unlink()
    if todo:
        rewrite(site, todo, reverse, tmp)
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


def cmd_status(site: Path, overlay: Path, tmp: Path) -> bool:
    """Print the state of every touched file and module; True when all is as the repo has it."""
    released = released_hashes(site)
    files, modules = file_states(site, released, tmp)[0], module_states(site, overlay, released)
    others = {
        rel: "foreign" for rel in foreign(site, released, list(modules)) if rel not in modules
    }
    left = {rel: "stray" for rel in strays(site, [*files, *modules])}
    print(f"{DIST} {VERSION} in {site}")
    for kind, states in (("touched files", files), ("our modules", modules | others)):
        print("\n".join([f"{kind}:", *listing(states)]))
    if left:
        print("\n".join(["left by an interrupted run:", *listing(left)]))
    if "modified" in files.values():
        print("\n".join([SHALLOW, START_CLEAN]))
    return files == dict.fromkeys(touched(), "patched") and set(modules.values()) <= {"installed"}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line (see the module docstring) and run one command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("apply", "revert", "status"))
    parser.add_argument("--site", type=Path, help="directory that holds the trinity package")
    parser.add_argument("--overlay", type=Path, default=REPO / "trinity", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    site = (args.site or Path(str(importlib.metadata.distribution(DIST).locate_file("")))).resolve()
    try:
        with tempfile.TemporaryDirectory(prefix="trinity-patches-") as scratch:
            tmp, overlay = Path(scratch), args.overlay.resolve()
            if args.command != "status":
                with locked(site):
                    cmd_apply(site, overlay, args.command == "revert", tmp)
            elif not cmd_status(site, overlay, tmp):
                return 1  # not everything is patched and installed as the repo has it
    except OSError as error:  # a read-only site, say: what failed where, in one line
        if error.filename is None:
            raise
        where = Path(error.filename).parent
        raise SystemExit(f"cannot {args.command} in {where}: {error.strerror}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
