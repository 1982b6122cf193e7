#!/usr/bin/env python3
"""Apply, revert and show (status) this repo's changes to an installed trinity-rft.

patches/series is applied by ``git apply`` to copies that move into place together. A file is
released if its sha256 is RECORD's (an editable install's RECORD lists no package file: then
RELEASED's), patched if reverse-applying the series gives those bytes, outdated if
reverse-applying a series of an earlier commit (read from git history) gives them: ``apply``
moves it to this series, ``revert`` to the release. A file that no series known here explains
but whose bytes an ``apply`` recorded is newer (a newer checkout's output). Anything else is
refused, by name. Each file is patched or reverted on its own, so a run stopped between two
renames leaves a mix that the next run completes. Our ``trinity/*.py`` are copied in (hashes in
trinity/.bapo-installed.json); a copy edited in place or a file not ours is never overwritten or
removed. Temporary files (``.NAME.PID.tmp``) left by a killed run are removed.

A file at one of our module paths is ours when that record lists it or, failing that, when pip's
RECORD does not and its bytes are the repo's module (``apply`` records it, ``revert`` removes it).
Other files pip did not install are left alone; ``status`` calls those at or beside our module
paths (older copies of ours, say) foreign. Where trinity-rft is gone or another version, only
``revert`` acts: it removes what of ours is left. ``apply`` and ``revert`` take turns, by an flock.
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
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse
from urllib.request import url2pathname

REPO = Path(__file__).resolve().parent.parent
DIST, VERSION = "trinity-rft", "0.6.0"
RECORD = "trinity/.bapo-installed.json"
PATCHED = ".patched"  # the record's key for the files `apply` patched (no module path is this)
# sha256 of the 0.6.0 release's files that a series of this repository touches or touched, for an
# editable install, whose RECORD lists no package file (tests check these against the wheel's)
RELEASED = {
    "trinity/algorithm/__init__.py": (
        "90ecc5ad83edcd7b66a0285419e7314aff763e04dae31b0f29bb07cd33d3961e"
    ),
    "trinity/algorithm/algorithm.py": (
        "71366a5ada4bdf62e0fd6641c9edb6923e31944813f6b346981bf5ea869070a5"
    ),
    "trinity/algorithm/policy_loss_fn/__init__.py": (
        "7aacc695978ed9e3898c5605b45fef3d73c3b1b9650ab793f162ac9a9c26c882"
    ),
    "trinity/algorithm/policy_loss_fn/policy_loss_fn.py": (
        "8a09fa70085f0d0c86b9d9e5893c304eac4f1c0aa09787e261ce6f79da37d0dc"
    ),
    "trinity/common/config_validator.py": (
        "256b0cba8abbc4206931de386bcede07523ad294345f9ac03e421970193d1ae0"
    ),
    "trinity/trainer/verl/losses.py": (
        "9a57132abe5c24a1d64e09f21d7d1009bf43ca546ad1e0c3465308ec5b149d67"
    ),
    "trinity/trainer/verl/workers.py": (
        "9ac70e41a2d0e8b7f1343140f99f1f24b68f8dd974e60aa2fd62206e54ed5e07"
    ),
    "trinity/trainer/verl_legacy/dp_actor.py": (
        "4350d889f3562508cf78c8bd1029e23b541321d38b65f4866b704c7166cd73e7"
    ),
}
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
    "newer": "written by an `apply`, but neither by this checkout nor by a commit in its git "
    "history: it may come from a newer checkout of this repository (or uncommitted work), whose "
    "`apply` and `revert` handle it; here a touched file is refused, a module replaced (`apply`) "
    "or removed (`revert`)",
}
SHALLOW = (
    "A file an earlier commit's series patched counts as modified where this checkout lacks that "
    "commit (an archive, a shallow clone: `git fetch --unshallow`)."
)
START_CLEAN = f"To start clean: pip install --force-reinstall --no-deps {DIST}=={VERSION}"
EDITABLE = (
    f"{DIST} is an editable install: a touched file of its source tree that is neither the "
    f"{VERSION} release nor patched is the developer's, and left to them (move the change away, "
    "or take the file from the release), then rerun."
)


class Install(NamedTuple):
    """The trinity package the tool works on, and what of it is the release's."""

    site: Path  # the directory that holds the package
    version: str | None  # the trinity-rft installed there; None where there is none
    released: dict[str, str]  # site-relative path -> sha256 of the released bytes, where known
    files: set[str]  # the release's files, which are never ours to replace or remove
    editable: bool  # a source tree (``pip install -e``), whose every file not ours is the release's


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


def source_tree(dist: importlib.metadata.Distribution) -> Path | None:
    """The source tree of an editable install (PEP 610's direct_url.json), else None."""
    info = json.loads(dist.read_text("direct_url.json") or "{}")
    if not info.get("dir_info", {}).get("editable"):
        return None
    return Path(url2pathname(urlparse(info["url"]).path))


def locate(site: Path | None) -> tuple[Path, importlib.metadata.Distribution | None]:
    """The directory that holds the trinity package, and trinity-rft's metadata (None: none).

    That is an editable install's source tree, else `site`, by default where the running Python
    has trinity-rft or, without one, its site-packages, where an uninstall leaves our files.
    """
    if site is None:
        dists = list(importlib.metadata.distributions(name=DIST))[:1]  # the one Python imports
        site = Path(str(dists[0].locate_file(""))) if dists else Path(sysconfig.get_path("purelib"))
    else:
        dists = list(importlib.metadata.distributions(name=DIST, path=[str(site)]))
        if len(dists) > 1:
            raise SystemExit(f"{len(dists)} {DIST} installations found in {site}; expected one")
    dist = next(iter(dists), None)
    return ((dist and source_tree(dist)) or site).resolve(), dist


def inspect(site: Path, dist: importlib.metadata.Distribution | None, overlay: Path) -> Install:
    """What of `site` is the release's: RECORD's files, or a source tree's files not ours.

    RECORD's sha256 give the released bytes; a source tree's files are judged by RELEASED's.
    """
    if dist is None:
        return Install(site, None, {}, set(), False)
    hashes = {str(f): f.hash.value for f in dist.files or [] if f.hash and f.hash.mode == "sha256"}
    released = {rel: base64.urlsafe_b64decode(h + "==").hex() for rel, h in hashes.items()}
    if "trinity/__init__.py" in released:
        return Install(site, dist.version, released, set(released), False)
    if not (site / "trinity" / "__init__.py").is_file():
        raise SystemExit(
            f"{DIST} is an editable install, and {site} holds no trinity package: "
            "name the source tree's directory that holds it with --site"
        )
    states = module_states(site, overlay, set())
    ours = {rel for rel, state in states.items() if state not in ("absent", "foreign")}
    found = {str(p.relative_to(site)) for p in (site / "trinity").rglob("*") if p.is_file()}
    return Install(site, dist.version, RELEASED, found - ours - {RECORD}, True)


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
    """Put copies of the sources at their targets by one rename each, keeping a target's mode.

    All copies are made before the first rename. A failure leaves no copy behind, but a rename
    that fails (an immutable target) leaves the targets renamed before it replaced.
    """
    pending = []
    try:
        for rel, src in sources.items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            tmp = (site / rel).with_name(f".{Path(rel).name}.{os.getpid()}.tmp")
            pending.append((tmp, site / rel))
            shutil.copyfile(src, tmp)
            exists = (site / rel).exists()
            os.chmod(tmp, stat.S_IMODE((site / rel).stat().st_mode) if exists else 0o644)
        for tmp, dst in pending:
            os.replace(tmp, dst)  # a fresh mtime, so no cached bytecode of the old copy matches
    except BaseException:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)  # gone once renamed
        raise


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


def commits(*paths: str) -> list[str]:
    """The commits of the repository's history that change `paths`, newest first."""
    log = subprocess.run(["git", "log", "--format=%H", "--", *paths], cwd=REPO, capture_output=True)
    return log.stdout.decode().split()


def earlier_series(tmp: Path) -> list[list[Path]]:
    """Each other series the repository's git history holds, newest first, written under `tmp`.

    Empty where the checkout has no history (an archive); a shallow clone gives its own part.
    """
    changed = commits("patches/series", ":(glob)patches/*.patch")
    listing = dict(zip(changed, git_files([f"{c}:patches/series" for c in changed])))
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


def repo_versions(rels: list[str]) -> set[tuple[str, str]]:
    """(path, sha256) of every version of the repository's files `rels` in its git history."""
    specs = [(commit, rel) for commit in commits(*rels) for rel in rels] if rels else []
    texts = git_files([f"{commit}:{rel}" for commit, rel in specs])
    return {
        (rel, hashlib.sha256(text.encode()).hexdigest())
        for (_, rel), text in zip(specs, texts)
        if text is not None
    }


def undo(site: Path, rel: str, want: str | None, patches: list[Path], tmp: Path) -> Path | None:
    """A scratch copy of `rel` with `patches` reversed, if that gives the released bytes."""
    root = stage({rel: site / rel}, tmp)
    done = git_apply(root, "-R", f"--include={rel}", *patches[::-1])
    return None if done.returncode or sha256(root / rel) != want else root / rel


def file_states(install: Install, tmp: Path) -> tuple[dict, dict]:
    """The state of every file this series or an earlier one touches; released bytes if known.

    'released', 'patched' (this series' output), 'outdated' (an earlier series' output), 'newer'
    (neither, but bytes an `apply` recorded), 'modified' (anything else) or 'missing'; the
    released bytes (a path) of the first three. A file that only an earlier series touched is
    listed unless it is released.
    """
    site, earlier, current = install.site, earlier_series(tmp), set(touched())
    written = recorded(site).get(PATCHED, {})
    states, copies = {}, {}
    for rel in sorted(current.union(*map(touched, earlier))):
        copy, want = None, install.released.get(rel)
        if not (site / rel).is_file():
            states[rel] = "missing"
        elif sha256(site / rel) == want:
            states[rel], copy = "released", site / rel
        elif rel in current and (copy := undo(site, rel, want, series(), tmp)):
            states[rel] = "patched"
        elif copy := next(filter(None, (undo(site, rel, want, p, tmp) for p in earlier)), None):
            states[rel] = "outdated"
        else:
            states[rel] = "newer" if sha256(site / rel) == written.get(rel) else "modified"
        if copy:
            copies[rel] = copy
    return {rel: s for rel, s in states.items() if rel in current or s != "released"}, copies


def advice(install: Install, states: set[str]) -> list[str]:
    """The ways out of files neither released nor patched, none replacing an editable install."""
    if install.editable:
        return [EDITABLE]
    return [SHALLOW] * ("modified" in states) + [START_CLEAN]


def pending(install: Install, action: str, tmp: Path) -> dict[str, Path]:
    """The files still to patch (or revert), with their released bytes.

    Refuses, naming files, unless each is released, patched or outdated.
    """
    states, copies = file_states(install, tmp)
    if set(states.values()) <= {"released", "patched", "outdated"}:
        todo = {"apply": "released", "revert": "patched"}[action]
        return {rel: copies[rel] for rel, state in states.items() if state in (todo, "outdated")}
    lines = [f"refusing to {action}: a touched file is neither released nor patched"]
    for rel, state in states.items():
        lines.append(f"  {state:<9} {rel}")
        if state in ("modified", "missing"):
            digest = sha256(install.site / rel) if state == "modified" else "-"
            lines += [
                f"      sha256   {digest}",
                f"      released {install.released.get(rel, '-')}",
            ]
    lines += notes({"newer"} & set(states.values()))
    raise SystemExit("\n".join([*lines, *advice(install, set(states.values()))]))


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


def module_states(site: Path, overlay: Path, files: set[str]) -> dict[str, str]:
    """Map each repo module and recorded copy to its state; see `clashes`.

    A recorded copy is installed, outdated (recorded bytes, the repo's in its history), stale
    (the same, of a module the repo no longer has), newer (recorded bytes the history lacks) or
    modified; a file the record lacks is unrecorded (the repo's bytes: ours) or foreign; a path
    among the release's `files` is blocked.
    """
    record, sources, states = read_record(site), repo_modules(overlay), {}
    for rel in sorted(set(sources) | set(record)):
        src, dst, state = sources.get(rel), site / rel, "absent"
        if rel in files:
            state = "blocked"
        elif dst.exists() and rel in record:
            digest = sha256(dst)
            if src and digest == sha256(src):
                state = "installed"
            else:
                state = "recorded" if digest == record[rel] else "modified"
        elif dst.exists() and src:
            state = "unrecorded" if sha256(dst) == sha256(src) else "foreign"
        states[rel] = state
    earlier = [rel for rel, state in states.items() if state == "recorded"]
    known = repo_versions(earlier)
    for rel in earlier:
        older = "outdated" if rel in sources else "stale"
        states[rel] = older if (rel, record[rel]) in known else "newer"
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


def foreign(install: Install, rels: list[str]) -> list[str]:
    """Files ``*.py`` beside the modules `rels` that neither the release nor our record has."""
    site = install.site
    found = {str(p.relative_to(site)) for rel in rels for p in (site / rel).parent.glob("*.py")}
    return sorted(found - install.files - set(read_record(site)))


def notes(states: set[str]) -> list[str]:
    """What the given states mean, for those that need a word."""
    return [f"{state}: {NOTES[state]}" for state in sorted(states & set(NOTES))]


def listing(states: dict[str, str]) -> list[str]:
    """One line per file, then what the states that need a word mean, for the user to act on."""
    return [f"  {state:<9} {rel}" for rel, state in states.items()] + notes(set(states.values()))


def recorded(site: Path) -> dict:
    """The record as written: our modules' sha256 by path, the patched files' under PATCHED."""
    return json.loads((site / RECORD).read_text()) if (site / RECORD).is_file() else {}


def read_record(site: Path) -> dict[str, str]:
    """Our installed modules: site-relative path -> sha256 of the copy."""
    return {rel: digest for rel, digest in recorded(site).items() if rel != PATCHED}


def remove_modules(site: Path, rels: list[str]) -> None:
    """Remove our files, their bytecode, and the directories that leaves empty.

    Those are our own, or `trinity/` itself once pip's files are gone (pip leaves none empty).
    """
    for rel in rels:
        (site / rel).unlink(missing_ok=True)
        for pyc in (site / rel).parent.glob(f"__pycache__/{Path(rel).stem}.*.pyc"):
            pyc.unlink()
        for directory in Path(rel).parents[:-1]:  # up to `trinity/`
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


def write_record(site: Path, record: dict) -> None:
    """Replace our record of what `apply` wrote in one rename, as ``place`` does."""
    with tempfile.TemporaryDirectory(prefix="trinity-patches-") as tmp:
        Path(tmp, "record.json").write_text(json.dumps(record, indent=1, sort_keys=True))
        place(site, {RECORD: Path(tmp, "record.json")})


def unavailable(install: Install) -> str:
    """Why the series has nothing to work on: no trinity-rft where it looked, or another one."""
    if install.version is None:
        return f"{DIST} is not installed in {install.site}"
    return f"{DIST} {install.version} is installed in {install.site}; the series is for {VERSION}"


def elsewhere(install: Install, states: dict[str, str]) -> str:
    """One line: why the series cannot act here, and the command that removes what of ours is."""
    site, line = install.site, unavailable(install)
    if (site / RECORD).is_file() or set(states.values()) - {"absent", "blocked", "foreign"}:
        tool = [sys.executable, str(Path(__file__).resolve())]
        command = shlex.join([*tool, "revert", "--site", str(site)])
        line += f"; files of ours that an `apply` put there remain: `{command}` removes them"
    return line


def sync_modules(
    install: Install, overlay: Path, states: dict[str, str], wanted: set[str]
) -> tuple[int, int]:
    """Install the modules `wanted`, remove other copies of ours: how many removed, copied."""
    site, before = install.site, recorded(install.site)
    ours = set(read_record(site)) | {rel for rel, state in states.items() if state == "unrecorded"}
    removed = sorted(ours - wanted - install.files)  # never a file pip installed
    remove_modules(site, removed)
    copied = ("absent", "outdated", "newer")  # the others are ours in place, or refused
    copies = {rel: overlay.parent / rel for rel in wanted if states[rel] in copied}
    place(site, copies)
    record: dict = {rel: sha256(site / rel) for rel in wanted}
    if record:
        record[PATCHED] = {rel: sha256(site / rel) for rel in touched()}
        if record != before:
            write_record(site, record)
    else:
        remove_modules(site, [RECORD])  # last, and with `trinity/` if nothing else is left there
    return len(removed), len(copies)


def cmd_apply(install: Install, overlay: Path, reverse: bool, tmp: Path) -> None:
    """Patch or revert (finishing what a stopped run left), then install or remove our modules.

    Where no trinity-rft 0.6.0 is installed, `revert` removes only what of ours is left.
    """
    site, action = install.site, "revert" if reverse else "apply"
    states = module_states(site, overlay, install.files)
    if install.version != VERSION and not reverse:
        raise SystemExit(elsewhere(install, states))
    todo = pending(install, action, tmp) if install.version == VERSION else {}
    wanted = set() if reverse else set(repo_modules(overlay))
    refused = clashes(states, wanted)
    if refused:
        lines = [f"refusing to {action}: these files are not ours to replace or remove:"]
        raise SystemExit("\n".join([*lines, *listing(refused)]))
    for rel in strays(site, [*touched(), *states]):  # under the lock: no run is writing them
        (site / rel).unlink()
    watched = sorted({*touched(), *todo, *states, RECORD})
    before = fingerprint(site, watched)
    try:
        if todo:
            rewrite(site, todo, reverse, tmp)
        removed, copied = sync_modules(install, overlay, states, wanted)
    except OSError as error:
        if fingerprint(site, watched) != before:
            other, state = ("apply", "reverted") if reverse else ("revert", "patched")
            error.add_note(
                f"{DIST} in {site} is now partly {state}: `{action}` once the cause is fixed, "
                f"or `{other}`, finishes it"
            )
        raise
    if install.version == VERSION:
        done = [patch for patch in series() if set(touched([patch])) & set(todo)]
        print(f"{len(done)} of {len(series())} patches {'reverted' if reverse else 'applied'} now")
    else:
        print(f"{unavailable(install)}: only files of ours were removed")
    if reverse:
        left = {rel: "foreign" for rel in foreign(install, list(states))}
        print("\n".join([f"our modules: {removed} removed", *listing(left)]))
    else:
        print(f"our modules: {len(wanted)} installed, {copied} of them copied now")


def fingerprint(site: Path, rels: list[str]) -> dict[str, str | None]:
    """The sha256 of each of `rels` (None where absent): did a failed run change any?"""
    return {rel: sha256(site / rel) if (site / rel).is_file() else None for rel in rels}


def cmd_status(install: Install, overlay: Path, tmp: Path) -> bool:
    """Print the state of every touched file and module; True when all is as the repo has it."""
    site = install.site
    modules = module_states(site, overlay, install.files)
    if install.version != VERSION:
        raise SystemExit(elsewhere(install, modules))
    files = file_states(install, tmp)[0]
    others = {rel: "foreign" for rel in foreign(install, list(modules)) if rel not in modules}
    left = {rel: "stray" for rel in strays(site, [*files, *modules])}
    print(f"{DIST} {VERSION}{' (editable)' * install.editable} in {site}")
    for kind, states in (("touched files", files), ("our modules", modules | others)):
        print("\n".join([f"{kind}:", *listing(states)]))
    if left:
        print("\n".join(["left by an interrupted run:", *listing(left)]))
    if "modified" in files.values():
        print("\n".join(advice(install, set(files.values()))))
    return files == dict.fromkeys(touched(), "patched") and set(modules.values()) <= {"installed"}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line (see the module docstring) and run one command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("apply", "revert", "status"))
    parser.add_argument("--site", type=Path, help="directory that holds the trinity package")
    parser.add_argument("--overlay", type=Path, default=REPO / "trinity", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="trinity-patches-") as scratch:
            (site, dist), tmp, overlay = locate(args.site), Path(scratch), args.overlay.resolve()
            if args.command != "status":
                with locked(site):
                    install = inspect(site, dist, overlay)
                    cmd_apply(install, overlay, args.command == "revert", tmp)
            elif not cmd_status(inspect(site, dist, overlay), overlay, tmp):
                return 1  # not everything is patched and installed as the repo has it
    except OSError as error:  # a read-only site, say: what failed where, in one line
        if error.filename is None:
            raise
        where = Path(error.filename).parent
        notes = "".join(f"; {note}" for note in getattr(error, "__notes__", []))
        raise SystemExit(f"cannot {args.command} in {where}: {error.strerror}{notes}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
