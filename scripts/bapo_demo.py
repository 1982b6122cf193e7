#!/usr/bin/env python
"""`make demo`: a real multi-rank PPO-vs-BAPO training run on CPU, with plots.

Launches ``torchrun --standalone --nproc_per_node=R`` (gloo) on ``scripts/demo/worker.py``,
which trains a tiny random-init Llama in verl's FSDP training engine (FSDPEngineWithLMHead,
FSDP2) on a synthetic task with a verifiable reward, from GRPO rollouts sampled by a copy of
the policy ``--staleness`` updates old, twice on the same seeds: PPO with fixed clipping
(0.8, 1.28) and BAPO with the paper's defaults, both through Trinity's engine loss
(TrinityPolicyLoss), which the engine calls with its data-parallel group. The parent then draws
``<out>/report.png`` and prints a summary; the last stdout line is one JSON object.

Exit status: 0 on success, 1 if the ranks used different clip pairs (or the loss never saw the
dp group), 2 if the workers failed, 3 if they timed out.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from demo import report  # noqa: E402

EXIT_DISAGREE, EXIT_WORKER_FAILED, EXIT_TIMEOUT = 1, 2, 3


def parse_args(argv=None) -> argparse.Namespace:
    """The launcher's flags; the worker gets them passed on."""
    p = argparse.ArgumentParser(
        description="Train a tiny LM with PPO and with BAPO on R CPU ranks and plot both.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # 300 steps: the reward has risen from 0.25 to about 0.6-0.7 and entropy has fallen below
    # 1, and both runs together take about 4 minutes on 2 busy cores (README, "The demo").
    p.add_argument("--steps", type=int, default=300, help="training steps per algorithm")
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (processes)")
    p.add_argument(
        "--staleness", type=int, default=4, help="training steps the rollout policy lags behind"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/demo", help="output folder")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    p.add_argument("--log-every", type=int, default=10, help="progress line every N steps")
    p.add_argument(
        "--no-sync",
        action="store_true",
        help="BAPO without the dp all-reduce (sync_across_dp=false): each rank searches its "
        "own tokens, the ranks may pick different pairs, and the run then exits 1",
    )
    args = p.parse_args(argv)
    for name in ("steps", "ranks", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.staleness < 0:
        p.error("--staleness must be >= 0")
    return args


def worker_command(args) -> list:
    """The torchrun command line that starts the workers."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.ranks}",
        str(HERE / "demo" / "worker.py"),
        "--algos",
        ",".join(report.ALGOS),
        "--steps",
        str(args.steps),
        "--staleness",
        str(args.staleness),
        "--seed",
        str(args.seed),
        "--out",
        str(args.out),
        "--log-every",
        str(args.log_every),
    ] + (["--no-sync"] if args.no_sync else [])


def launch(args, log_path: Path) -> Optional[int]:
    """Run the workers; stdout (progress) passes through, stderr goes to ``log_path``.

    Returns the launcher's exit code, or None on timeout (the whole process group is killed).
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            worker_command(args), stdout=sys.stdout, stderr=log, env=env, start_new_session=True
        )
        try:
            return proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return None


def tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log file, for an error message."""
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def main(argv=None) -> int:
    """Launch, collect, plot, judge; returns the exit status."""
    args = parse_args(argv)
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for algo in report.ALGOS:  # never report a previous run's numbers
        (out / algo / "metrics.jsonl").unlink(missing_ok=True)
    (out / "report.png").unlink(missing_ok=True)
    log_path = out / "workers.stderr.log"
    print(
        f"launching {args.ranks} ranks (gloo) for PPO then BAPO, {args.steps} steps each, "
        f"staleness {args.staleness}; worker stderr -> {log_path}",
        flush=True,
    )

    code = launch(args, log_path)
    if code is None or code != 0:
        what = f"timed out after {args.timeout:.0f} s" if code is None else f"exited {code}"
        print(f"workers {what}; last lines of {log_path}:\n{tail(log_path)}", file=sys.stderr)
        return EXIT_TIMEOUT if code is None else EXIT_WORKER_FAILED

    runs = {}
    for algo in report.ALGOS:
        path = out / algo / "metrics.jsonl"
        rows = report.load_metrics(path) if path.exists() else []
        if len(rows) != args.steps:
            print(f"{path}: expected {args.steps} steps, found {len(rows)}", file=sys.stderr)
            return EXIT_WORKER_FAILED
        runs[algo] = rows
    title = (
        f"tiny Llama in verl's FSDP2 engine, {args.ranks} ranks (gloo), GRPO groups of 8, "
        f"rollout policy {args.staleness} steps stale, seed {args.seed}"
    )
    report.plot(runs, out / "report.png", title)

    summaries = {algo: report.summarise(rows) for algo, rows in runs.items()}
    ranks_agree = all(s["ranks_agree"] for s in summaries.values())
    forwarded = all(s["dp_group_forwarded"] for s in summaries.values())
    engine = summaries[report.ALGOS[0]]["engine"]
    print("\n".join(report.human_summary(summaries)))
    print(f"report: {out / 'report.png'}")
    result = {
        "ranks_agree": ranks_agree,
        "dp_group_forwarded": forwarded,
        "engine": engine,
        **{algo: summaries[algo] for algo in report.ALGOS},
        "ranks": args.ranks,
        "steps": args.steps,
        "staleness": args.staleness,
        "seed": args.seed,
        "bapo_sync_across_dp": not args.no_sync,
        "report": str(out / "report.png"),
        "wall_time_s": round(time.time() - started, 1),
    }
    print(json.dumps(result), flush=True)
    return 0 if ranks_agree and forwarded else EXIT_DISAGREE


if __name__ == "__main__":
    sys.exit(main())
