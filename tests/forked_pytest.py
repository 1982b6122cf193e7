"""``python -m pytest`` in a source tree, forked from a server that imported torch and verl once.

A fresh interpreter spends most of such a run importing torch, verl and transformers before a
test of a few seconds. The server (this file run as a script) imports them, never ``trinity``
(each tree brings its own) nor a test, then forks one child per run: the child takes the run's
cwd (the tree, which ``''`` at the head of ``sys.path`` names, as the cwd does for ``python -m``),
its environment and output files, runs the hook a ``sitecustomize.py`` would have run at start,
then ``pytest.main``. The ranks a test forks inherit what the hook did, as they do today.
"""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn, Optional

# What the trees' tests import through trinity, each a package of the environment, not the tree's
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.multiprocessing",
    "tensordict",
    "transformers",
    "ray",
    "verl.protocol",
    "verl.trainer.ppo.core_algos",
    "verl.workers.engine_workers",
    "verl.workers.utils.losses",
    "torch.utils.tensorboard",
    "wandb",
    "yaml",
    "pytest",
)
# The server's code, with '' (the child's cwd) first on sys.path as `python -m` has its cwd
LAUNCH = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


class Server:
    """One server process; ``pytest`` answers as ``subprocess.run`` would for a fresh pytest."""

    def __init__(self, scratch: Path) -> None:
        """Start the server in ``scratch`` (which also takes each run's output files)."""
        self.scratch, self.runs = scratch, 0
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, __file__],
            cwd=scratch,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def pytest(
        self, cwd: Path, args: list[str], env: dict[str, str], hook: Optional[Path], timeout: int
    ) -> subprocess.CompletedProcess:
        """Run ``pytest.main(args)`` in ``cwd``; a run past ``timeout`` seconds is killed (-9)."""
        assert self.process.stdin and self.process.stdout
        self.runs += 1
        out, err = (self.scratch / f"{self.runs}.{name}" for name in ("out", "err"))
        paths = {"cwd": str(cwd), "hook": hook and str(hook), "out": str(out), "err": str(err)}
        request = {**paths, "args": args, "env": env, "timeout": timeout}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the pytest server stopped ({self.process.poll()})")
        return subprocess.CompletedProcess(args, int(answer), out.read_text(), err.read_text())

    def close(self) -> None:
        """End the server (it stops at the end of its input)."""
        assert self.process.stdin
        self.process.stdin.close()
        self.process.wait(timeout=60)


def serve() -> None:
    """Import the environment's heavy packages, then answer each request line with its status."""
    for name in PRELOAD:
        importlib.import_module(name)
    assert not [name for name in sys.modules if name.split(".")[0] in ("trinity", "tests")]
    for line in sys.stdin:
        print(run_forked(**json.loads(line)), flush=True)
    os._exit(0)  # nothing to clean up: spare the finalization of what was imported


def run_forked(cwd: str, hook: Optional[str], out: str, err: str, args, env, timeout) -> int:
    """Fork a child for the run and wait for it, killing it past the timeout."""
    pid = os.fork()
    if pid == 0:
        child(cwd, hook, out, err, args, env)
    deadline = time.monotonic() + timeout
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return os.waitstatus_to_exitcode(done[1])


def child(cwd: str, hook: Optional[str], out: str, err: str, args, env) -> NoReturn:
    """Become the run: its files, cwd and environment, the hook, pytest; trinity from ``cwd``."""
    status = 3  # pytest's internal error: neither a pass nor a test's failure
    try:
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, 0), (2, err, 0)):
            os.dup2(os.open(path, flags or os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if hook:
            exec(compile(Path(hook).read_text(), hook, "exec"), {"__name__": "sitecustomize"})
        import pytest

        status = int(pytest.main(args))
        trinity = sys.modules.get("trinity")
        if trinity and not Path(str(trinity.__file__)).is_relative_to(cwd):
            print(f"trinity was imported from {trinity.__file__}, not {cwd}", file=sys.stderr)
            status = 3
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    serve()
