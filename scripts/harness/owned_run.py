"""Every launcher's lifecycle: it owns each process it starts, and a signal ends them all, then it.

``owned_run()`` wraps the work of ``make demo``, ``experiment``, ``sensitivity``, ``bench`` and
``trinity-run`` (both modes). torchrun, Ray and ``trinity run`` lead process groups of their own,
so a terminal's Ctrl-C (SIGINT to the foreground process group) reaches the launcher alone; it is
the launcher that ends them:

- SIGINT, SIGTERM and SIGHUP get a handler first. Python runs it in the main thread, whatever the
  others do (a study trains from a thread pool, whose end would wait on its launches). It closes
  ``launch.spawn``'s gate, so that no process starts after it; kills every live descendant of
  the launcher (``kill_descendants``); kills every process of the Rays it started, found by
  their mark; then raises ``Interrupted``, so that every ``finally`` on the way out runs.
- Every Ray begun by ``start_ray`` is stopped process by process, its link removed, also one
  whose start a signal cut short (by its folder). Before the first, the Rays that killed launches
  left running are named on stderr (``ray_local.name_left_rays``); none is stopped.
- The last line is ``summary()`` as JSON with ``"interrupted"`` (``Run.finish``; after a signal
  also ``"signal"``, and for any launcher), and the launcher then dies by that signal (exit status
  128 + N in a shell), after a last sweep for a process that a thread started meanwhile.
"""

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import psutil

from scripts.harness.launch import ENDING, GATE
from scripts.harness.ray_local import RayHead, kill_ray, name_left_rays, start_ray, stop_ray

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A signal ended the run; raised by the handler so that the stack unwinds."""


def descendants() -> List[psutil.Process]:
    """The live processes under this one, however deep (zombies aside: they have ended)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def kill_descendants(timeout_s: float = 10) -> int:
    """SIGKILL every live descendant of this process; how many there were.

    Each is stopped first (SIGSTOP), until a look finds none unstopped: a stopped process forks no
    more, and a child it forked before is found under it, where killing its parent first would
    hand it to init, out of this tree. Then all are killed together.
    """
    stopped: set = set()
    deadline = time.monotonic() + timeout_s
    while (new := set(descendants()) - stopped) and time.monotonic() < deadline:
        for proc in new:
            with contextlib.suppress(psutil.Error):
                proc.suspend()
        stopped |= new
    for proc in stopped:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return len(stopped)


class Run:
    """One launch's processes, Rays and final JSON line."""

    def __init__(self, summary: Callable[[], dict] = dict):
        """``summary`` gives the JSON line's fields, also for a run cut short."""
        self.summary = summary
        self.rays: Dict[Path, Optional[RayHead]] = {}  # None while the head starts
        self.signum: Optional[int] = None
        self.closing = False
        self.printed: Optional[dict] = None

    def interrupt(self, signum: int, frame) -> None:
        """The signals' handler: the first one ends every process, then unwinds the run."""
        if self.signum is not None:
            return
        with GATE:  # a start under way in another thread ends first, so its process is found
            self.signum = signum
            ENDING.set()
        self.end_all()
        if not self.closing:
            raise Interrupted(signal.Signals(signum).name)

    def end_all(self) -> None:
        """Kill every descendant and every process of the Rays this run started."""
        kill_descendants()
        for folder in list(self.rays):
            kill_ray(folder)

    def start_ray(self, folder: Path, gpus: int, worker_env: Dict[str, str]) -> RayHead:
        """``ray_local.start_ray``, stopped when the run ends, even if cut short meanwhile."""
        if not self.rays:
            name_left_rays()
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
        """Stop the Rays; after a signal, kill what is left and print the JSON line if not yet."""
        self.closing = True
        self.stop_rays()
        if self.signum is not None:
            self.end_all()
            if self.printed is None:
                self.finish()


@contextlib.contextmanager
def owned_run(summary: Callable[[], dict] = dict) -> Iterator[Run]:
    """Own every process the body starts (see the module docstring); ``summary`` as ``Run``'s."""
    run = Run(summary)
    previous = {signum: signal.signal(signum, run.interrupt) for signum in SIGNALS}
    try:
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
