#!/usr/bin/env python3
"""Apply, revert and inspect this repo's changes to an installed trinity-rft.

The repo never carries upstream code. It changes the installed package in two ways:

* patches/series lists unified diffs against the released files; they are applied with
  GNU patch. patches/manifest.json records, per touched file, the sha256 of the released
  file and of the file after the whole series, so every step can tell "released",
  "patched" and "something else" apart and refuse instead of guessing.
* every *.py file under the repo's trinity/ tree is symlinked into the installed package
  at the same path, so our modules import as upstream ones would and edits need no
  reinstall. New files belong there, never in a patch.

Commands:
  apply    [--site DIR]  patch the released files (no-op if patched), then link our modules
  revert   [--site DIR]  restore the released files (no-op if released), unlink our modules
  status   [--site DIR]  show the state of each touched file and of the links; exit 0
  manifest --pristine DIR [--output FILE]
                         recompute the manifest from released files (maintainers)

DIR is the directory that contains the `trinity` package (site-packages); by default the
one the running interpreter would import it from. Refusals exit 1, usage errors exit 2.
To change a patch: revert, edit, rerun `manifest`, apply.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATCH_DIR = REPO / "patches"
MANIFEST = PATCH_DIR / "manifest.json"
DISTRIBUTION = "trinity-rft"
REINSTALL_HINT = "To start clean: pip install --force-reinstall --no-deps {dist}=={version}"


class Refusal(Exception):
    """An expected stop whose message is all the user needs (no traceback)."""


# --- hashes and the patch series ---------------------------------------------------------


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes: the identity every state check is based on."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def series_names() -> list[str]:
    """Patch names in application order, read quilt-style (comments and options ignored)."""
    names = []
    for line in (PATCH_DIR / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line.split()[0])
    return names


def touched_files(patch: Path) -> list[str]:
    """Site-relative paths a diff changes. A file header is a `--- a/...` line directly
    followed by `+++ b/...`; requiring the pair keeps hunk lines from being misread."""
    lines = patch.read_text().splitlines()
    paths = []
    for old, new in zip(lines, lines[1:]):
        if old.startswith("--- ") and new.startswith("+++ "):
            names = [line[4:].split("\t", 1)[0].strip() for line in (old, new)]
            if "/dev/null" in names:
                raise Refusal(f"{patch.name} creates or deletes a file; put new files in trinity/")
            paths.append(names[1].split("/", 1)[1])
    return paths


def series_fingerprint() -> list[dict]:
    """Name and hash of each patch, stored in the manifest so a stale one is caught."""
    return [{"patch": n, "sha256": sha256(PATCH_DIR / n)} for n in series_names()]


def run_series(root: Path, reverse: bool) -> None:
    """Apply (or reverse-apply, last patch first) the whole series to the tree at `root`."""
    names = series_names()
    for name in reversed(names) if reverse else names:
        cmd = ["patch", "-p1", "--no-backup-if-mismatch", "-s", "--batch", "--fuzz=0",
               "-R" if reverse else "-N", "-d", str(root), "-i", str(PATCH_DIR / name)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise Refusal("GNU patch is not installed (needed to apply the series)") from None
        if done.returncode != 0:
            verb = "reverse-apply" if reverse else "apply"
            raise Refusal(f"{name} did not {verb} cleanly:\n{done.stdout}{done.stderr}".rstrip())


# --- the installed package ---------------------------------------------------------------


def default_site() -> Path:
    """Where the running interpreter would import `trinity` from, found without importing it
    (importing trinity takes seconds and would load the files we are about to change)."""
    spec = importlib.util.find_spec("trinity")
    if spec is None or spec.origin is None or not spec.origin.endswith("__init__.py"):
        raise Refusal(f"{DISTRIBUTION} is not installed for {sys.executable}; pass --site DIR")
    return Path(spec.origin).parent.parent


def installed_version(site: Path) -> str | None:
    """Version from the distribution's METADATA in `site`; None if there is none."""
    found = sorted(site.glob("trinity_rft-*.dist-info/METADATA"))
    if len(found) > 1:
        raise Refusal(f"several trinity_rft dist-info directories in {site}; reinstall it")
    if not found:
        return None
    for line in found[0].read_text(encoding="utf-8").splitlines():
        if not line:
            break
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def check_site(site: Path, expected: str) -> None:
    """Refuse to touch anything unless the site holds the release the series was made for."""
    if not (site / "trinity" / "__init__.py").is_file():
        raise Refusal(f"no trinity package in {site}")
    version = installed_version(site)
    if version is None:
        raise Refusal(f"no {DISTRIBUTION} metadata in {site}; this patch series is for {expected}")
    if version != expected:
        raise Refusal(f"{DISTRIBUTION} {version} is installed; this patch series is for {expected}")


def read_manifest() -> dict:
    """The recorded hashes as they are on disk."""
    if not MANIFEST.is_file():
        raise Refusal(f"{MANIFEST} is missing; run: {Path(__file__).name} manifest --pristine DIR")
    return json.loads(MANIFEST.read_text())


def manifest_is_current(manifest: dict) -> bool:
    """Whether the manifest was recorded from the patches as they are now."""
    return manifest["series"] == series_fingerprint()


def load_manifest() -> dict:
    """The recorded hashes, refused if the patches changed since they were recorded."""
    manifest = read_manifest()
    if not manifest_is_current(manifest):
        raise Refusal(f"{MANIFEST.name} does not match patches/series; "
                      f"rerun: {Path(__file__).name} manifest --pristine DIR")
    return manifest


def file_state(site: Path, rel: str, expected: dict) -> tuple[str, str | None]:
    """('upstream' | 'patched' | 'modified' | 'missing', actual sha256) of one touched file."""
    path = site / rel
    if not path.is_file():
        return "missing", None
    digest = sha256(path)
    for state in ("upstream", "patched"):
        if digest == expected[state]:
            return state, digest
    return "modified", digest


def series_state(site: Path, manifest: dict, action: str) -> str:
    """'upstream' or 'patched' when all touched files agree. Otherwise refuse: list the
    modified or missing files with actual and expected hashes, or, if the series is merely
    half applied, the state of each file."""
    states = {rel: file_state(site, rel, exp) for rel, exp in manifest["files"].items()}
    kinds = {state for state, _ in states.values()}
    if kinds in ({"upstream"}, {"patched"}):
        return kinds.pop()
    odd = {rel: found for rel, found in states.items() if found[0] in ("modified", "missing")}
    if not odd:
        lines = [f"refusing to {action}: the series is only partly applied"]
        lines += [f"  {state:<9} {rel}" for rel, (state, _) in states.items()]
    else:
        lines = [f"refusing to {action}: these files are neither the released "
                 f"{manifest['version']} nor the patched ones"]
        for rel, (state, digest) in odd.items():
            exp = manifest["files"][rel]
            lines += [f"  {rel} ({state})", f"      sha256   {digest or '-'}",
                      f"      upstream {exp['upstream']}", f"      patched  {exp['patched']}"]
    lines.append(REINSTALL_HINT.format(dist=DISTRIBUTION, version=manifest["version"]))
    raise Refusal("\n".join(lines))


def rewrite_series(site: Path, manifest: dict, reverse: bool) -> None:
    """Run the series on a staging copy, check every result against the manifest, and only
    then swap the results into the site, so a failure anywhere leaves the site as it was."""
    files, target = manifest["files"], "upstream" if reverse else "patched"
    with tempfile.TemporaryDirectory(prefix="trinity-patches-") as tmp:
        stage = Path(tmp)
        for rel in files:
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(site / rel, stage / rel)
        run_series(stage, reverse)
        wrong = [rel for rel, exp in files.items() if sha256(stage / rel) != exp[target]]
        if wrong:
            raise Refusal(f"the series did not give the recorded {target} content for: "
                          f"{', '.join(wrong)}; is {MANIFEST.name} current?")
        replace_files(stage, site, list(files))


def replace_files(stage: Path, site: Path, rels: list[str]) -> None:
    """Copy every staged file next to its target first, then rename them all into place:
    renames within a directory do not fail halfway the way copies can."""
    pending = []
    try:
        for rel in rels:
            dst = site / rel
            fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
            os.close(fd)
            pending.append((Path(tmp), dst))
            shutil.copyfile(stage / rel, tmp)
            shutil.copymode(dst, tmp)
    except BaseException:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, dst in pending:
        os.replace(tmp, dst)


# --- overlay of our own modules ----------------------------------------------------------


def overlay_sources(overlay: Path) -> list[str]:
    """Our module files, site-relative (overlay is the repo's trinity/ directory)."""
    return sorted(str(p.relative_to(overlay.parent)) for p in overlay.rglob("*.py")
                  if "__pycache__" not in p.parts)


def link_target(link: Path) -> Path:
    """Where a symlink points, as an absolute normalised path (it may dangle)."""
    target = Path(os.readlink(link))
    return Path(os.path.normpath(link.parent / target))


def our_links(site: Path, overlay: Path) -> list[Path]:
    """Every symlink in the installed package that points into our overlay tree."""
    links = []
    for dirpath, _, filenames in os.walk(site / "trinity"):
        for name in filenames:
            path = Path(dirpath, name)
            if path.is_symlink() and link_target(path).is_relative_to(overlay):
                links.append(path)
    return sorted(links)


def plan_links(site: Path, overlay: Path) -> list[tuple[Path, Path]]:
    """(link, source) pairs still to create; refuses if any would shadow an upstream file or
    sit where a non-directory is in the way. Run before patching, so a refusal changes nothing."""
    todo, clashes = [], []
    for rel in overlay_sources(overlay):
        link, source = site / rel, overlay.parent / rel
        blocked = [p for p in link.parents if p.is_relative_to(site) and p.exists()
                   and not p.is_dir()]
        if blocked:
            clashes.append(f"  {blocked[0].relative_to(site)} is not a directory")
        elif link.is_symlink() and link_target(link).is_relative_to(overlay):
            if link_target(link) != source:
                todo.append((link, source))
        elif link.exists() or link.is_symlink():
            clashes.append(f"  {rel} exists in the installed package")
        else:
            todo.append((link, source))
    if clashes:
        raise Refusal("refusing to link our modules over upstream files:\n" + "\n".join(clashes))
    return todo


def remove_link(link: Path) -> None:
    """Drop one of our links and the bytecode Python cached for it."""
    link.unlink()
    for pyc in (link.parent / "__pycache__").glob(f"{link.stem}.*.pyc"):
        pyc.unlink()


def prune_dirs(start: Path, site: Path) -> None:
    """Remove directories left empty by unlinking, up to the package root. pip never installs
    an empty directory, so an empty one can only be one this tool created."""
    root = site / "trinity"
    for directory in [start, *start.parents]:
        if directory == root or not directory.is_relative_to(root):
            return
        cache = directory / "__pycache__"
        if cache.is_dir() and not any(cache.iterdir()):
            cache.rmdir()
        if any(directory.iterdir()):
            return
        directory.rmdir()


def unlink_stale(site: Path, overlay: Path, keep: set[Path]) -> int:
    """Remove our links other than `keep` (e.g. to renamed files); returns how many."""
    stale = [link for link in our_links(site, overlay) if link not in keep]
    for link in stale:
        remove_link(link)
        prune_dirs(link.parent, site)
    return len(stale)


def link_overlay(site: Path, overlay: Path, todo: list[tuple[Path, Path]]) -> None:
    """Create the planned links (and any missing directories, which then hold only ours)."""
    for link, source in todo:
        if link.is_symlink():
            link.unlink()
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(source)


# --- commands ----------------------------------------------------------------------------


def cmd_apply(site: Path, overlay: Path) -> None:
    """Patch (unless already patched), then bring the links in line with our modules."""
    manifest = load_manifest()
    check_site(site, manifest["version"])
    state = series_state(site, manifest, "apply")
    todo = plan_links(site, overlay)
    if state == "patched":
        print("patch series already applied")
    else:
        rewrite_series(site, manifest, reverse=False)
        print(f"applied {len(manifest['series'])} patches to {len(manifest['files'])} files")
    keep = {site / rel for rel in overlay_sources(overlay)}
    removed = unlink_stale(site, overlay, keep)
    link_overlay(site, overlay, todo)
    print(f"overlay: {len(keep)} modules linked ({len(todo)} new"
          + (f", {removed} stale links removed)" if removed else ")"))


def cmd_revert(site: Path, overlay: Path) -> None:
    """Restore the released files (unless already released) and remove all our links."""
    manifest = load_manifest()
    check_site(site, manifest["version"])
    if series_state(site, manifest, "revert") == "upstream":
        print("patch series not applied")
    else:
        rewrite_series(site, manifest, reverse=True)
        print(f"restored {len(manifest['files'])} released files")
    print(f"removed {unlink_stale(site, overlay, keep=set())} links to our modules")


def cmd_status(site: Path, overlay: Path) -> None:
    """Report without judging: what each touched file is and which links exist."""
    manifest = read_manifest()
    if not manifest_is_current(manifest):
        print(f"warning: {MANIFEST.name} does not match patches/series")
    print(f"{DISTRIBUTION} {installed_version(site) or 'not found'} in {site} "
          f"(series is for {manifest['version']})")
    print("touched files:")
    for rel, expected in manifest["files"].items():
        print(f"  {file_state(site, rel, expected)[0]:<9} {rel}")
    print("overlay:")
    linked = {link: link_target(link) for link in our_links(site, overlay)}
    for rel in overlay_sources(overlay):
        link = site / rel
        if link in linked:
            print(f"  linked    {rel} -> {linked.pop(link)}")
        else:
            print(f"  {'blocked' if link.exists() else 'unlinked':<9} {rel}")
    for link, target in linked.items():
        print(f"  stale     {link.relative_to(site)} -> {target}")


def cmd_manifest(pristine: Path, output: Path) -> None:
    """Record released and patched hashes by running the series on a copy of `pristine`."""
    version = installed_version(pristine)
    if version is None:
        raise Refusal(f"no {DISTRIBUTION} metadata in {pristine}")
    files = sorted({rel for name in series_names() for rel in touched_files(PATCH_DIR / name)})
    missing = [rel for rel in files if not (pristine / rel).is_file()]
    if missing:
        raise Refusal(f"not in {pristine}: {', '.join(missing)}")
    with tempfile.TemporaryDirectory(prefix="trinity-manifest-") as tmp:
        stage = Path(tmp)
        for rel in files:
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pristine / rel, stage / rel)
        run_series(stage, reverse=False)
        hashes = {rel: {"upstream": sha256(pristine / rel), "patched": sha256(stage / rel)}
                  for rel in files}
    manifest = {"distribution": DISTRIBUTION, "version": version,
                "series": series_fingerprint(), "files": hashes}
    output.write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {output} ({len(files)} files, {DISTRIBUTION} {version})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line as described in the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("apply", "patch and link"), ("revert", "restore the release"),
                       ("status", "show the current state")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--site", type=Path, help="directory containing the trinity package")
        sub.add_argument("--overlay", type=Path, default=REPO / "trinity",
                         help="our module tree to link (default: the repo's trinity/)")
    sub = commands.add_parser("manifest", help="rewrite patches/manifest.json")
    sub.add_argument("--pristine", type=Path, required=True,
                     help="directory holding the released trinity package and its dist-info")
    sub.add_argument("--output", type=Path, default=MANIFEST, help="where to write it")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Dispatch; expected refusals print one message and return 1."""
    args = parse_args(argv)
    try:
        if args.command == "manifest":
            cmd_manifest(args.pristine.resolve(), args.output)
            return 0
        site = (args.site or default_site()).resolve()
        overlay = args.overlay.resolve()
        {"apply": cmd_apply, "revert": cmd_revert, "status": cmd_status}[args.command](
            site, overlay)
    except Refusal as refusal:
        print(f"{Path(__file__).name}: {refusal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
