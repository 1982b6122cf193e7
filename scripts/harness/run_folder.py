"""Where a launch writes: only a folder it made or claimed itself, in this launch.

Every launcher that writes a run folder (``scripts/experiment.py``'s three jobs,
``scripts/trinity_run.py`` in both modes) takes it from ``claim``, before any work:

- No ``--out``: a new folder ``runs/<job>/<YYYYmmdd-HHMMSS>`` under the current directory (with
  ``-2``, ``-3`` ... where that name is taken), made with ``mkdir``, whose success is the claim;
  then ``runs/<job>/latest`` links to it.
- ``--out DIR``: made, parents too, where nothing is there; an empty folder is claimed by creating
  ``LOCK`` in it (``O_EXCL``: of two launches on it one wins; ``O_NOFOLLOW``: a link put there
  meanwhile is never followed). Anything else (a file, a link, a folder holding anything, even
  one a launch made) is refused with one line naming it.

Nothing is ever emptied, taken over or deleted: a second launch gets a folder of its own, as
Hydra's, Lightning's and wandb's runs do.
"""

import itertools
import os
import sys
import time
from pathlib import Path
from typing import Optional

RUNS = Path("runs")  # under the current directory: the checkout's root, where make runs
LOCK = ".bapo-run.lock"  # the claim of an empty folder given as --out; it holds the launch's PID
TAKES = "--out takes a new or an empty folder"


def claim(out: Optional[Path], job: str) -> Path:
    """The folder this launch writes into, made or claimed by it now, as an absolute path.

    ``out`` is ``--out`` (None: a new folder under ``runs/<job>``); SystemExit names what is
    refused.
    """
    if out is None:
        try:
            return new_folder(RUNS / job)
        except OSError as err:  # runs/<job> a file, or no right to write there
            raise SystemExit(f"{RUNS / job}: {err.strerror}; name a folder with --out") from None
    try:
        out.mkdir(parents=True)  # a new folder: its creation is the claim
        return out.resolve()
    except FileExistsError:
        pass
    except OSError as err:
        raise SystemExit(f"{out}: {err.strerror}; {TAKES}") from None
    if out.is_symlink() or not out.is_dir():
        raise SystemExit(f"{out} is not a folder (a file or a link); {TAKES}")
    if holds_anything(out):
        raise SystemExit(f"{out} is not empty; {TAKES}, and nothing in this one is touched")
    try:
        fd = os.open(out / LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError:  # there meanwhile: another launch's claim, or a link
        raise SystemExit(f"{out} was claimed meanwhile ({LOCK} is there); {TAKES}") from None
    with os.fdopen(fd, "w") as lock:
        lock.write(f"{os.getpid()}\n")
    return out.resolve()


def holds_anything(folder: Path) -> bool:
    """Whether ``folder`` holds a file, a folder or a link, hidden ones too."""
    return any(folder.iterdir())


def new_folder(parent: Path) -> Path:
    """A new folder under ``parent`` named by the time, and ``parent/latest`` linked to it."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for count in itertools.count(1):
        folder = parent / (stamp if count == 1 else f"{stamp}-{count}")
        try:
            folder.mkdir()
            break
        except FileExistsError:
            continue
    point_latest(parent / "latest", folder.name)
    return folder.resolve()


def point_latest(latest: Path, name: str) -> None:
    """Link ``latest`` to ``name`` (relative) in one step: a new link renamed over the old one.

    A ``latest`` that is no link (someone's own file or folder) is left as it is, and said so.
    """
    if os.path.lexists(latest) and not latest.is_symlink():
        print(f"{latest} is not a link: left as it is", file=sys.stderr)
        return
    temp = latest.with_name(f".latest-{name}")  # the folder's name is new: so is this one
    os.symlink(name, temp)
    os.replace(temp, latest)
