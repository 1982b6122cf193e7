"""A launch that owns its output folder, and cleans up however it ends.

``owned_run(out, summary)`` is the one lifecycle of a launcher that starts Rays under ``out``:

- SIGINT, SIGTERM and SIGHUP get a handler first, so that a signal at any moment (before a Ray is
  up, while it starts, while it trains, during the report) raises ``Interrupted`` in the main
  thread, and every ``finally`` on the way out runs; Python's default SIGTERM and SIGHUP skip them.
- ``out`` must be a folder that does not exist, an empty one, or one a launch made (it holds the
  lock file): any other is refused at once, with one line naming it, and nothing in it touched.
- ``out`` is locked (an flock on ``out/.bapo-run.lock``, which holds the PID): a second launch on
  it exits at once with one line naming the folder and that PID, and the first is untouched. The
  kernel drops the lock of a dead launch, so its folder is taken over: once locked, the folder is
  emptied, after the Rays a dead launch started in it are killed (by their mark: no other
  process); nothing of an earlier run is read.
- Every Ray begun by ``start_ray`` is stopped process by process, its link removed, also a Ray
  whose start a signal cut short (by its folder). After a signal every process of it is killed
  at once (its head gets no grace to stop its children): the folder is not reused.
- The last line is ``summary()`` as JSON with ``"interrupted"``; after a signal also ``"signal"``,
  and the launcher then dies by that signal (exit status 128 + N in a shell), after the cleanup.
"""

import contextlib
import fcntl
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional

from scripts.harness.ray_local import RayHead, kill_ray, start_ray, stop_ray

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOCK = ".bapo-run.lock"  # in the folder, which ``clear`` empties around it: a launch made it


class Interrupted(BaseException):
    """A signal ended the run; raised by the handler so that the stack unwinds."""


class Run:
    """One launch's folder, lock, Rays and final JSON line."""

    def __init__(self, out: Path, summary: Callable[[], dict]):
        """``summary`` gives the JSON line's fields, also for a run cut short."""
        self.out, self.summary = out, summary
        self.rays: Dict[Path, Optional[RayHead]] = {}  # None while the head starts
        self.signum: Optional[int] = None
        self.closing, self.lock_fd = False, -1
        self.printed: Optional[dict] = None

    def interrupt(self, signum: int, frame) -> None:
        """The signals' handler: the first one unwinds the run, unless it is already closing."""
        if self.signum is None:
            self.signum = signum
            if not self.closing:
                raise Interrupted(signal.Signals(signum).name)

    def claim(self) -> None:
        """Exit naming the folder, touching nothing, unless it is new, empty, or a launch's."""
        if self.out.exists() and not self.out.is_dir():
            raise SystemExit(f"{self.out} is not a folder")
        if self.out.is_dir() and not (self.out / LOCK).is_file() and any(self.out.iterdir()):
            raise SystemExit(
                f"{self.out} holds files and no {LOCK}, so no launch made it; refusing to empty "
                "it: name a new or empty folder"
            )

    def lock(self) -> None:
        """Lock the folder, or exit naming it and the PID of the launch that holds it."""
        self.out.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode().strip() or "unknown"
            os.close(fd)
            raise SystemExit(f"{self.out} is in use by another run, PID {holder}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.lock_fd = fd

    def clear(self) -> None:
        """Empty the folder but for the lock, first killing any Ray a dead launch left in it."""
        for path in self.out.iterdir():
            if path.is_dir() and not path.is_symlink():
                kill_ray(path)
                shutil.rmtree(path)
            elif path.name != LOCK:
                path.unlink()

    def start_ray(self, folder: Path, gpus: int, worker_env: Dict[str, str]) -> RayHead:
        """``ray_local.start_ray``, stopped when the run ends, even if cut short meanwhile."""
        self.rays[folder] = None
        self.rays[folder] = head = start_ray(folder, gpus, worker_env)
        return head

    def stop_rays(self) -> None:
        """Stop every Ray this run started or began to start; after a signal, with no grace."""
        while self.rays:
            folder, head = self.rays.popitem()
            if head is None or self.signum is not None:
                kill_ray(folder)
            else:
                stop_ray(head)

    def finish(self) -> dict:
        """Stop the Rays, then print the JSON line and return it; a signal now is kept for later."""
        self.closing = True
        self.stop_rays()
        result = {**self.summary(), "interrupted": self.signum is not None}
        if self.signum is not None:
            result["signal"] = signal.Signals(self.signum).name
        print(json.dumps(result), flush=True)
        self.printed = result
        return result

    def close(self) -> None:
        """Stop the Rays, print the JSON line if a signal cut the run short, free the folder."""
        self.closing = True
        self.stop_rays()
        if self.signum is not None and self.printed is None:
            self.finish()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)


@contextlib.contextmanager
def owned_run(out: Path, summary: Callable[[], dict]) -> Iterator[Run]:
    """Own ``out`` for the body (see the module docstring); ``Run.finish`` prints the last line."""
    run = Run(out, summary)
    previous = {signum: signal.signal(signum, run.interrupt) for signum in SIGNALS}
    try:
        run.claim()
        run.lock()
        run.clear()
        yield run
    except Interrupted:
        pass  # run.signum says which; run.close prints the line
    finally:
        run.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if run.signum is not None:  # die by it, as the caller's shell expects of a signalled child
        signal.signal(run.signum, signal.SIG_DFL)
        os.kill(os.getpid(), run.signum)
