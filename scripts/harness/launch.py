"""The one torchrun launcher, with pinned numerics (the same figures from one launch to the next).

On timeout the launch's whole process group is killed, so no worker outlives its caller. Every
process a launcher starts passes ``spawn``, whose gate ``owned_run`` closes on a signal: a thread
of a study that is about to start its next torchrun then starts none.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Optional

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[2]
# ATen's portable kernels rather than those it picks by CPU capability (AVX2, AVX512), MKL's
# reproducible code path, oneDNN held to SSE4.1: the same bits under an emulated Intel CPU as on
# an AMD one, but not yet on every CPU (docs/results.md, Reproducibility).
PINNED_NUMERICS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
PINNED_NUMERICS["ONEDNN_MAX_CPU_ISA"] = "SSE41"


GATE = threading.RLock()  # held while a process starts, and by the signal handler that ends all
ENDING = threading.Event()  # set under GATE: no process starts any more


def spawn(cmd, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen``, refused once the launch is ending.

    Under ``GATE``, so that the handler closing it waits for a start under way: the process it
    then kills is there to find.
    """
    with GATE:
        if ENDING.is_set():
            raise RuntimeError("the launch is ending on a signal: no process starts")
        return subprocess.Popen(cmd, **kwargs)


class Launch(NamedTuple):
    """How a launch ended: exit code (None on timeout), its output and its wall time."""

    code: Optional[int]
    out: str
    err: str
    seconds: float


def torchrun(nproc: int, module: str, argv, timeout_s: float, stdout=None) -> Launch:
    """Run ``module`` with ``argv`` on ``nproc`` ranks; ``stdout`` streams it (else ``out``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", "-m", module, *map(str, argv)]
    env = {**os.environ, **PINNED_NUMERICS, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["HF_HUB_OFFLINE"] = "1"
    started, pipe = time.monotonic(), subprocess.PIPE
    proc = spawn(
        cmd,
        cwd=REPO,
        env=env,
        stdout=stdout or pipe,
        stderr=pipe,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    return Launch(code, out or "", err, time.monotonic() - started)


def gather_rows(row: "torch.Tensor") -> list:
    """Every rank's ``row`` (a vector of one length), as lists.

    torch is imported here, on the ranks: a launcher (``trinity_run``'s refusal) starts without it.
    """
    import torch
    import torch.distributed as dist

    gathered = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, row)
    return [g.tolist() for g in gathered]


def tail(text: str, lines: int = 40) -> str:
    """The last lines of a long output, for an error message."""
    return "\n".join(text.splitlines()[-lines:])
