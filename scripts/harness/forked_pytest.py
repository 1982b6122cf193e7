"""``python -m pytest`` in a source tree, forked from a server that imported torch and verl once.

A fresh interpreter spends most of such a run importing torch, verl and transformers before a
test of a few seconds. The server (this file run as a script) imports them, never ``trinity``
(each tree brings its own) nor a test, then forks one child per run: the child takes the run's
cwd (the tree, which ``''`` at the head of ``sys.path`` names, as the cwd does for ``python -m``),
its environment and output files, runs the hook a ``sitecustomize.py`` would have run at start,
then ``pytest.main``. The ranks a test forks inherit what the hook did, as they do today.

Given a Unix socket, the server also takes runs from other processes, several at once:
``python scripts/harness/forked_pytest.py client SOCKET TIMEOUT -- ARGS`` is ``python -m pytest
ARGS`` in the caller's cwd and environment (a mutation tester's test command).
"""

import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
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

    def __init__(self, scratch: Path, listen: Optional[Path] = None) -> None:
        """Start the server in ``scratch`` (which also takes each run's output files).

        ``listen``: a Unix socket it also answers clients on.
        """
        self.scratch, self.runs = scratch, 0
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, __file__, *([str(listen)] if listen else [])],
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


def serve(listen: Optional[str] = None) -> None:
    """Import the environment's heavy packages, then answer each request with its status.

    Requests come as lines on stdin, and as connections on the socket ``listen``, each answered
    by a process of its own; the server ends with its input.
    """
    for name in PRELOAD:
        importlib.import_module(name)
    assert not [name for name in sys.modules if name.split(".")[0] in ("trinity", "tests")]
    gc.freeze()  # what they made is never collected: pytest's closing gc.collect() skips it
    sources: list = [sys.stdin]
    if listen:
        sources.append(socket.socket(socket.AF_UNIX))
        sources[1].bind(listen)
        sources[1].listen()
    while True:
        ready = select.select(sources, [], [])[0]
        reap()
        if sys.stdin not in ready:
            answer_connection(*sources[1].accept())
        elif not (line := sys.stdin.readline()):
            break
        else:
            print(run_forked(**json.loads(line)), flush=True)
    os._exit(0)  # nothing to clean up: spare the finalization of what was imported


def reap() -> None:
    """Collect the processes that answered connections and ended."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:  # none is left
        pass


def answer_connection(connection: socket.socket, _address) -> None:
    """Answer one client's request (a JSON line) with its status, from a process of its own."""
    if os.fork():
        connection.close()
        return
    with connection, connection.makefile("rw") as stream:
        stream.write(f"{run_forked(**json.loads(stream.readline()))}\n")
    os._exit(0)


def client(listen: str, timeout: str, dashes: str, *args: str) -> int:
    """``python -m pytest *args`` in this cwd and environment, run by the server on ``listen``."""
    assert dashes == "--", "usage: client SOCKET TIMEOUT -- PYTEST_ARGS"
    with tempfile.TemporaryDirectory() as scratch, socket.socket(socket.AF_UNIX) as connection:
        out, err = (os.path.join(scratch, name) for name in ("out", "err"))
        request: dict = dict(cwd=os.getcwd(), hook=None, out=out, err=err, args=list(args))
        request.update(env=dict(os.environ), timeout=float(timeout))
        connection.connect(listen)
        with connection.makefile("rw") as stream:
            stream.write(json.dumps(request) + "\n")
            stream.flush()
            status = int(stream.readline() or 3)
        for name, to in ((out, sys.stdout), (err, sys.stderr)):
            to.write(Path(name).read_text() if os.path.exists(name) else "")
    return 0 if status == 0 else 1


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
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))  # as at a start
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
    if sys.argv[1:2] == ["client"]:
        sys.exit(client(*sys.argv[2:]))
    serve(*sys.argv[2:3])  # run by LAUNCH: [-c, this file, the socket if any]
