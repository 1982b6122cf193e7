"""``make trinity-run TRINITY_RUN_ARGS="--mode both"``: Trinity's asynchronous loop on CPUs.

``trinity run --config`` in ``mode: both``: one vLLM engine explores a task set built in code and
scores it with a rule reward; 2 FSDP2 ranks train BAPO on its rollouts from a queue; with
``sync_method: checkpoint`` the explorer reloads the trainer's checkpoint every ``sync_interval``
steps while running ``sync_offset`` steps ahead, so the trained rollouts are stale. The launch
both modes share (``scripts/harness/trinity_launch.py``) runs it with a GPU slot more for the
engine; its workers take the trainer's CPU stand-ins and the explorer's
(``scripts/harness/cpu.py``), and not our pinned numerics, under which vLLM's compiled CPU
sampler does not build.

Read from Trinity's log: the trainer's ``Step N:`` lines (BAPO's pair and rho, the versions of
the samples trained on: ``sample/model_version/*``), the explorer's (``rollout/model_version``,
the version it rolled out with) and its reloads (``New model weights version: N``). Prints a
line per trainer step, then one JSON line; ``trinity_launch.problems`` adds, in this mode, a
missing reload of a trainer checkpoint to what makes the exit code 1.
"""

import math
import re
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from scripts.harness.cpu import VLLM_STAND_INS_ENV
from scripts.harness.launch import PINNED_NUMERICS
from scripts.harness.trinity_inputs import Rollout
from scripts.harness.trinity_launch import PAIR_KEYS, launch
from scripts.harness.trinity_launch import report as train_report
from scripts.harness.trinity_launch import worker_env

ERROR = re.compile(r"(\w+(?:Error|Exception): .+)$", re.M)  # a traceback's last line
RELOAD = re.compile(r"New model weights version: (\d+)")  # the explorer loaded a checkpoint
VERSIONS = ("sample/model_version/min", "sample/model_version/max")  # of a trained batch
EXPLORER_VERSION, REWARD = "rollout/model_version", "critic/rewards/mean"
# What vLLM's CPU backend reads: 1 GiB of KV cache, OpenMP threads left where the OS puts them.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def both_worker_env(out: Path, stand_ins: bool) -> Dict[str, str]:
    """The workers' environment of ``mode: train``, less the pinned numerics, with vLLM's."""
    env = {k: v for k, v in worker_env(out).items() if k not in PINNED_NUMERICS}
    return {**env, **VLLM_CPU_ENV, VLLM_STAND_INS_ENV: "1" if stand_ins else "0"}


def is_trainers(metrics: dict) -> bool:
    """Whether a ``Step N:`` line is the trainer's: it holds ``actor/`` metrics.

    Both monitors log ``Step N:`` lines; an explorer line holds ``rollout/`` or ``explore/`` ones.
    """
    return any(key.startswith("actor/") for key in metrics)


def split_roles(lines: List[Tuple[int, dict]]) -> Tuple[Dict[int, dict], Dict[int, dict]]:
    """The trainer's and the explorer's metrics per step, each role's lines of a step merged."""
    trainer: Dict[int, dict] = {}
    explorer: Dict[int, dict] = {}
    for step, metrics in lines:
        role = trainer if is_trainers(metrics) else explorer
        role.setdefault(step, {}).update(metrics)
    return trainer, explorer


def progress(steps: int):
    """What ``run_trinity`` shows: per trainer step, the versions, the pair, rho, the reward."""
    started, explorer_version = time.monotonic(), [math.nan]

    def show(step: int, metrics: Dict[str, float]) -> None:
        if EXPLORER_VERSION in metrics:
            explorer_version[0] = metrics[EXPLORER_VERSION]
        if not is_trainers(metrics):
            return
        low, high, rho = (metrics.get(key, math.nan) for key in PAIR_KEYS)
        oldest, newest = (metrics.get(key, math.nan) for key in VERSIONS)
        print(
            f"step {step}/{steps}: explorer at version {explorer_version[0]:.0f}, trained samples "
            f"of versions {oldest:.0f} to {newest:.0f} with version {step - 1}, clip "
            f"({low:.3f}, {high:.3f}), rho {rho:.3f}, reward {metrics.get(REWARD, math.nan):.3f}, "
            f"{time.monotonic() - started:.0f} s into trinity run",
            flush=True,
        )

    return show


def report(out: Path, args, code: Optional[int], lines: List[Tuple[int, dict]]) -> dict:
    """``trinity_launch.report`` on the trainer's lines, with the samples' versions and the reward.

    A step's samples are stale by the trainer's version (``step - 1``) less theirs. Then the
    explorer's versions, its reloads, and the last exception Trinity logged.
    """
    trainer, explorer = split_roles(lines)
    result = train_report(out, args, code, sorted(trainer.items()))
    steps = result["steps"]
    versions = [[trainer[s].get(k) for k in VERSIONS] for s in steps]
    rolled = [
        explorer[s][EXPLORER_VERSION] for s in sorted(explorer) if EXPLORER_VERSION in explorer[s]
    ]
    log = Path(result["log"])
    text = log.read_text(errors="replace") if log.exists() else ""
    error, reloaded = ERROR.search(text), [int(v) for v in RELOAD.findall(text)]
    return dict(
        mode="both",
        **result,
        trainer_versions=[s - 1 for s in steps],
        sample_versions=versions,
        staleness=[
            s - 1 - low if low is not None else None for s, (low, _) in zip(steps, versions)
        ],
        reward=[trainer[s].get(REWARD) for s in steps],
        explorer_versions=rolled,
        reloaded_versions=reloaded,
        syncs=len(reloaded),
        sync_interval=args.sync_interval,
        sync_offset=args.sync_offset,
        error=error.group(1).strip() if error else None,
    )


def run_both(args) -> int:
    """``trinity_launch.launch`` with a rollout engine, its stand-ins and vLLM's CPU settings."""
    rollout = Rollout(args.sync_interval, args.sync_offset)

    def workers(out: Path) -> Dict[str, str]:
        return both_worker_env(out, not args.no_stand_ins)

    return launch(args, rollout, workers, {}, progress, report)
