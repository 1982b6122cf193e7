"""A Ray of one's own on this machine: its own folder, ports and HOME, and stopped exactly.

``ray stop`` stops every Ray on the machine, so it is never called: the head runs as
``ray start --block`` in a process group of its own, and stopping it signals that group, then
kills every process of this Ray. Those carry this Ray's mark in their environment, or descend
from a process that does: the workers inherit the mark, rename themselves (``ray::WorkerDict``)
and leave the group; Ray's agents (``ray::DashboardAgent``) write their new title over the mark,
but are the raylet's children (and end themselves when it goes). A process that merely holds a
file under the folder is never counted: it may be anyone's.
``RAY_AUTH_MODE=disabled`` and a HOME inside the folder keep Ray from writing a token under the
user's ``~/.ray``; every port is one found free, so that two runs can share a machine. Ray's
socket paths must fit in 107 bytes, so its temp dir is named by a short link: in the system's
temp dir, or in ``/tmp`` (where Ray's own ``/tmp/ray`` goes) where ``$TMPDIR`` is too long for
them. The files stay in the folder, and the link goes when Ray stops. The link's name comes
from the folder's path, so that whoever stops a Ray by its folder alone (a start cut short, or
one a killed launcher left) finds its link too.

The mark also names the launcher, by its PID and start time, so that a Ray whose launcher was
killed with SIGKILL (which no handler sees) is told apart from a live launch's: ``left_rays``
finds it, a launch names it on stderr, and it runs until its user stops it by its folder:
``python -m scripts.harness.ray_local stop FOLDER``, from the checkout's root.
"""

import argparse
import contextlib
import hashlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, NamedTuple

import psutil

from scripts.harness.launch import spawn

RAY = str(Path(sys.executable).parent / "ray")
MARK_ENV = "BAPO_RAY_FOLDER"  # the folder of the Ray a process belongs to
LAUNCHER_ENV = "BAPO_RAY_LAUNCHER"  # "PID:start time" of the launcher that started that Ray
PORTS = ["dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port"]
PORTS += ["metrics-export-port", "ray-client-server-port", "runtime-env-agent-port"]
# The longest path Ray gives a socket under its temp dir: the folder of one start, named by its time
# and the head's PID (at most 7 digits), then the plasma store's socket. At most 107 bytes.
RAY_SOCKET = "session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store"
SOCKET_MAX = 107


class RayHead(NamedTuple):
    """A running head: its process, its folder, the environment that reaches it."""

    proc: subprocess.Popen
    folder: Path
    env: Dict[str, str]


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def link_dir(folder: Path) -> Path:
    """The directory that holds the short link to ``folder``'s Ray, where Ray's sockets fit.

    In ``link_base()``; named by the folder's path, so that its Ray's folder alone finds it.
    """
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    return link_base() / f"bapo-ray-{digest}"


def link_base() -> Path:
    """Where the short links go: the temp dir, else ``/tmp``, where Ray's sockets fit in them.

    A link's name has one length whatever its folder, so this is known before the folder is; a
    RuntimeError says why where neither will do.
    """
    bases = [tempfile.gettempdir(), "/tmp"]
    name = "bapo-ray-" + "0" * 16
    for base in bases:
        fits = len(os.fsencode(Path(base) / name / "tmp" / RAY_SOCKET)) <= SOCKET_MAX
        if fits and os.access(base, os.W_OK):
            return Path(base)
    raise RuntimeError(
        f"Ray's socket paths under the temp dir {bases[0]} would exceed {SOCKET_MAX} bytes, "
        "and /tmp is not writable: set TMPDIR to a shorter folder"
    )


def mark(folder: Path) -> Dict[str, str]:
    """The environment that marks a process as of the Ray under ``folder``, started by this one."""
    me = psutil.Process()
    return {MARK_ENV: str(folder.resolve()), LAUNCHER_ENV: f"{me.pid}:{me.create_time()!r}"}


def launcher_alive(launcher: str) -> bool:
    """Whether the launcher a mark names (``PID:start time``) still runs.

    A later process that has its PID has another start time; a zombie has ended.
    """
    pid, started = launcher.split(":", 1)
    try:
        proc = psutil.Process(int(pid))
        return proc.create_time() == float(started) and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError):
        return False


def start_ray(folder: Path, gpus: int, worker_env: Dict[str, str], timeout_s=120) -> RayHead:
    """Start a head under ``folder`` declaring ``gpus`` GPU slots; ``worker_env`` reaches workers.

    Returns once ``ray status`` answers at the head's address. Workers inherit the environment
    of ``ray start``, so ``worker_env`` is given to it and not to the driver.
    """
    for part in ("home", "tmp"):
        (folder / part).mkdir(parents=True, exist_ok=True)
    link = link_dir(folder)
    shutil.rmtree(link, ignore_errors=True)  # one a killed launch on a folder of this path left
    link.mkdir(mode=0o700)
    (link / "tmp").symlink_to(folder.resolve() / "tmp")
    port = free_port()
    env = {**os.environ, "HOME": str(folder / "home"), "RAY_AUTH_MODE": "disabled"}
    env.update(mark(folder))
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS=f"127.0.0.1:{port}")
    env["RAY_prestart_worker_first_driver"] = "0"  # no idle workers started ahead, each a Python
    cmd = [RAY, "start", "--head", "--block", f"--port={port}", f"--num-gpus={gpus}"]
    cmd += ["--num-cpus=8", f"--temp-dir={link / 'tmp'}", "--include-dashboard=false"]
    cmd += [f"--{option}={free_port()}" for option in PORTS]
    with open(folder / "ray-start.log", "w") as log:
        proc = spawn(cmd, env={**env, **worker_env}, stdout=log, stderr=log, start_new_session=True)
    head = RayHead(proc, folder, env)
    deadline = time.monotonic() + timeout_s
    while subprocess.run([RAY, "status"], env=env, capture_output=True).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_ray(head)
            raise RuntimeError(f"Ray did not start; see {folder / 'ray-start.log'}")
        time.sleep(1)
    return head


def ray_processes(folder: Path) -> List[int]:
    """The pids of live processes of the Ray under ``folder``, this one's aside.

    Those whose environment holds the mark, and their descendants: Ray's agents retitle
    themselves over the memory ``/proc/<pid>/environ`` reads, mark included. Zombies aside:
    they are dead already, and only their parent's wait removes them.
    """
    mark = f"\0{MARK_ENV}={folder.resolve()}\0".encode()
    parents: Dict[int, int] = {}
    marked, live = set(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:  # the stat line: "pid (title) state ppid ..."
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            parents[pid] = int(parent)
            if state != "Z" and pid != os.getpid():
                live.append(pid)
            if mark in b"\0" + (entry / "environ").read_bytes():
                marked.add(pid)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return [pid for pid in live if of_marked(pid, parents, marked)]


def of_marked(pid: int, parents: Dict[int, int], marked: set) -> bool:
    """Whether ``pid`` or one of its ancestors (by ``parents``, pid to parent) is ``marked``."""
    while pid in parents and pid not in marked:
        pid = parents[pid]
    return pid in marked


def stop_ray(head: RayHead, grace_s: float = 2) -> None:
    """Stop this head and every process of its Ray; no other Ray on the machine is touched.

    The group gets a SIGTERM and ``grace_s`` to flush its logs, then each process is killed:
    ``ray start --block`` outlives a SIGTERM by more than 20 s, so a longer grace only waits.
    """
    try:
        os.killpg(head.proc.pid, signal.SIGTERM)
        head.proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    kill_ray(head.folder)
    head.proc.wait()


def kill_ray(folder: Path, timeout_s: float = 10) -> None:
    """Kill every live process of the Ray under ``folder`` and remove its link.

    Also a Ray a killed launcher left, or one whose start was cut short. Killed again until none
    is left, since a raylet may start a worker while its siblings die.
    """
    deadline = time.monotonic() + timeout_s
    while (pids := ray_processes(folder)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    with contextlib.suppress(RuntimeError):  # raised where no link could be made
        shutil.rmtree(link_dir(folder), ignore_errors=True)  # the link: rmtree does not follow it


def left_rays() -> Dict[Path, List[int]]:
    """The Rays whose launcher is gone, each folder with its processes' pids.

    A launcher killed with SIGKILL stopped nothing; a Ray marked before launchers were named in
    the mark is not counted (whose it is cannot be told).
    """
    folders = set()
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
        if MARK_ENV in env and LAUNCHER_ENV in env and not launcher_alive(env[LAUNCHER_ENV]):
            folders.add(Path(env[MARK_ENV]))
    found = {folder: ray_processes(folder) for folder in sorted(folders)}
    return {folder: pids for folder, pids in found.items() if pids}


def name_left_rays() -> None:
    """A line on stderr per Ray that a killed launch left: its folder, pids and stop command."""
    python = shlex.quote(sys.executable)
    for folder, pids in left_rays().items():
        stop = f"{python} -m scripts.harness.ray_local stop {shlex.quote(str(folder))}"
        print(
            f"a Ray left by a killed launch runs under {folder} (pids "
            f"{' '.join(map(str, pids))}); stop it from the checkout's root with: {stop}",
            file=sys.stderr,
        )


def main(argv=None) -> int:
    """``stop FOLDER``: kill every process of the Ray under FOLDER and remove its link."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("action", choices=["stop"])
    parser.add_argument("folder", type=Path, help="the Ray's folder, as a launch named it")
    args = parser.parse_args(argv)
    pids = ray_processes(args.folder)
    kill_ray(args.folder)
    print(f"stopped {len(pids)} processes of the Ray under {args.folder}: {pids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
