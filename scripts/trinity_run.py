"""``make trinity-run``: Trinity's own ``trinity run --config`` trains BAPO on 2 CPU ranks.

The command line, and ``--mode train``: the model, the buffer of stale GRPO groups and the
config (the example with a CPU's settings over it) are built under ``--out`` from code
(``scripts/harness/trinity_inputs.py``), and Trinity trains from that buffer on a Ray of its own
(``scripts/harness/trinity_launch.py``, which both modes share). Prints a line per step, then
one JSON line; exits 1 when a step, BAPO's pair or the checkpoint is missing, or when the ranks
chose apart with the sync on, and says why on stderr. Each launch writes into a folder it makes
(``scripts/harness/run_folder.py``): a new ``runs/trinity-run/<time>`` (``latest`` links to it),
or ``--out``, which must be new or empty; a signal ends every process it started, prints the
JSON line with the steps so far and ends the launch by it (``scripts/harness/owned_run.py``).

``--mode both`` runs Trinity's asynchronous loop instead, a vLLM explorer beside the trainer
(``scripts/trinity_both.py``: its inputs, progress lines and report, through the same
``launch``), in the environment of ``make setup-vllm``.
"""

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Dict

from scripts.harness.launch import PINNED_NUMERICS
from scripts.harness.trinity_launch import PAIR_KEYS, launch, report, worker_env
from scripts.trinity_both import run_both


def parse_args(argv=None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode", choices=("train", "both"), default="train", help="from a buffer, or explore too"
    )
    parser.add_argument("--steps", type=int, help="training steps of 16 sequences (3; both: 4)")
    parser.add_argument(
        "--out", type=Path, help="a new or empty folder (else a new one under runs/trinity-run)"
    )
    parser.add_argument(
        "--no-sync", action="store_true", help="sync_across_dp: false (the ranks may disagree)"
    )
    parser.add_argument(
        "--search-scope", choices=("micro_batch", "update"), default="micro_batch", help="BAPO's"
    )
    parser.add_argument("--sync-interval", type=int, default=2, help="mode both: sync_interval")
    parser.add_argument("--sync-offset", type=int, default=1, help="mode both: sync_offset")
    parser.add_argument(
        "--no-stand-ins", action="store_true", help="mode both: vLLM without the CPU stand-ins"
    )
    parser.add_argument("--timeout", type=float, help="seconds for `trinity run` (600; both: 900)")
    args = parser.parse_args(argv)
    both = args.mode == "both"
    args.steps = (4 if both else 3) if args.steps is None else args.steps
    args.timeout = args.timeout or (900 if both else 600)
    for name, least in (("steps", 1), ("sync_interval", 1), ("sync_offset", 0)):
        if getattr(args, name) < least:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be at least {least}, got {getattr(args, name)}")
    return args


def progress(steps: int):
    """What ``run_trinity`` shows of a trainer step: the pair, rho, the time since it started."""
    started = time.monotonic()

    def show(step: int, metrics: Dict[str, float]) -> None:
        low, high, rho = (metrics.get(key, math.nan) for key in PAIR_KEYS)
        seconds = time.monotonic() - started
        print(
            f"step {step}/{steps}: clip ({low:.3f}, {high:.3f}), rho {rho:.3f}, "
            f"{seconds:.0f} s into trinity run",
            flush=True,
        )

    return show


def main(argv=None) -> int:
    """Train from the prepared buffer, or (``--mode both``) beside a vLLM explorer."""
    args = parse_args(argv)
    if args.mode == "both":
        return run_both(args)
    return launch(args, None, worker_env, PINNED_NUMERICS, progress, report)


if __name__ == "__main__":
    sys.exit(main())
