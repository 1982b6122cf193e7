"""The one torchrun launcher (``python -m <module>`` on N ranks, under a timeout), and rank files.

On timeout the launch's whole process group is killed, so no worker outlives its caller. Every
launch runs with pinned numerics, so that a run gives the same figures on any x86-64 machine.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, NamedTuple, Optional

REPO = Path(__file__).resolve().parents[2]
# The same numbers on any x86-64 machine: ATen's portable kernels rather than those it picks by
# CPU capability (AVX2, AVX512), MKL's reproducible code path, oneDNN held to SSE4.1.
PINNED_NUMERICS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
PINNED_NUMERICS["ONEDNN_MAX_CPU_ISA"] = "SSE41"


class Launch(NamedTuple):
    """How a launch ended: exit code (None on timeout), its output and its wall time."""

    code: Optional[int]
    out: str
    err: str
    seconds: float


def torchrun(nproc: int, module: str, argv, timeout_s: float, stdout=None, path=None) -> Launch:
    """Run ``module`` with ``argv`` on ``nproc`` ranks from the repo root.

    ``stdout``: a file the workers' stdout streams to; ``path``: a ``PYTHONPATH`` folder.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", "-m", module, *map(str, argv)]
    env = {**os.environ, **PINNED_NUMERICS, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["HF_HUB_OFFLINE"] = "1"
    if path is not None:
        env["PYTHONPATH"] = str(path)
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        text=True,
        start_new_session=True,
        stdout=stdout or subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    return Launch(code, out or "", err, time.monotonic() - started)


def rank_records(out: Path, nproc: int) -> List[Optional[dict]]:
    """Each rank's JSON record from ``out``, None where a rank wrote none."""
    paths = [out / f"rank{rank}.json" for rank in range(nproc)]
    return [json.loads(p.read_text()) if p.exists() else None for p in paths]


def write_record(path: Path, record: dict) -> None:
    """Replace a rank's file in one step, so a killed run never leaves half a JSON."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, default=str))
    os.replace(partial, path)


def tail(text: str, lines: int = 40) -> str:
    """The last lines of a long output, for an error message."""
    return "\n".join(text.splitlines()[-lines:])
