"""A Ray of one's own on this machine: its own folder, ports and HOME, and stopped exactly.

``ray stop`` stops every Ray on the machine, so it is never called: the head runs as
``ray start --block`` in a process group of its own, and stopping it signals that group, then
kills whatever process still names this Ray's folder (Ray's daemons and workers carry it in
their command lines). ``RAY_AUTH_MODE=disabled`` and a HOME inside the folder keep Ray from
writing a token under the user's ``~/.ray``.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, NamedTuple

RAY = str(Path(sys.executable).parent / "ray")


class RayHead(NamedTuple):
    """A running head: its process, its folder, its address and the environment to reach it."""

    proc: subprocess.Popen
    folder: Path
    address: str
    env: Dict[str, str]


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ray(folder: Path, gpus: int, worker_env: Dict[str, str], timeout_s=120) -> RayHead:
    """Start a head under ``folder`` declaring ``gpus`` GPU slots; ``worker_env`` reaches workers.

    Returns once ``ray status`` answers at the head's address. Workers inherit the environment
    of ``ray start``, so ``worker_env`` is given to it and not to the driver.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "home").mkdir(exist_ok=True)
    port = free_port()
    env = {**os.environ, "HOME": str(folder / "home"), "RAY_AUTH_MODE": "disabled"}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS=f"127.0.0.1:{port}")
    cmd = [RAY, "start", "--head", "--block", f"--port={port}", f"--num-gpus={gpus}"]
    cmd += ["--num-cpus=8", f"--temp-dir={folder / 'tmp'}", "--include-dashboard=false"]
    for option in (
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
    ):
        cmd.append(f"--{option}={free_port()}")
    log = open(folder / "ray-start.log", "w")
    proc = subprocess.Popen(
        cmd, env={**env, **worker_env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    head = RayHead(proc, folder, env["RAY_ADDRESS"], env)
    deadline = time.monotonic() + timeout_s
    while subprocess.run([RAY, "status"], env=env, capture_output=True).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_ray(head)
            raise RuntimeError(f"Ray did not start; see {folder / 'ray-start.log'}")
        time.sleep(1)
    return head


def ray_processes(folder: Path) -> List[int]:
    """The pids of live processes whose command line names ``folder`` (this Ray's, and only)."""
    mark, found = str(folder.resolve()).encode(), []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return [pid for pid in found if pid != os.getpid()]


def stop_ray(head: RayHead, grace_s: float = 20) -> None:
    """Stop this head and every process of its Ray; no other Ray on the machine is touched."""
    try:
        os.killpg(head.proc.pid, signal.SIGTERM)
        head.proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in ray_processes(head.folder):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    head.proc.wait()
