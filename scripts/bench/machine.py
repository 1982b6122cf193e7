"""What the figures were measured on: printed in the bench header."""

import datetime
import os
import platform


def cpu_model() -> str:
    """Return the CPU model name from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    """Return the 1-, 5- and 15-minute load averages."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def malloc_settings() -> str:
    """Return the glibc tunables in this process's environment (they change buffer costs)."""
    tuned = [
        f"{k}={v}"
        for k, v in sorted(os.environ.items())
        if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"
    ]
    return ", ".join(tuned) if tuned else "glibc defaults (no MALLOC_* / GLIBC_TUNABLES set)"


def describe(threads: int, clock: str) -> list:
    """Return the report's header lines about this machine."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not available"
    return [
        f"date        {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"cpu         {cpu_model()}; {os.cpu_count()} logical cores, {usable} usable",
        f"load avg    {load_average()} (1/5/15 min; other jobs on these cores add noise)",
        f"python      {platform.python_version()}; torch {torch.__version__}; cuda {cuda}",
        f"threads     torch.set_num_threads({threads}); clock: {clock}",
        f"malloc      {malloc_settings()}",
    ]
