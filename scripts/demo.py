"""`make demo`: PPO against BAPO through verl's FSDP engine on R gloo ranks (CPU), with a figure.

The harness trainer, under torchrun, trains a tiny Llama on ``stop`` from rollouts ``--lag``
updates old, with PPO's pair (0.8, 1.28) and with BAPO's defaults, on the same seeds. Draws
``<out>/report.png`` (``--update-docs`` copies it into docs/); the last stdout line is one JSON
object.
Exit status 1 if the ranks used different pairs or the loss missed the engine's group, 2 if the
workers failed, 3 if they timed out. Run: python -m scripts.demo [--steps N] [--ranks R]
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from scripts.harness import report
from scripts.harness.launch import tail, torchrun
from scripts.harness.variants import variant

VARIANTS = ("ppo_clip_higher", "bapo_paper")


def parse_args(argv=None) -> argparse.Namespace:
    """The demo's flags; the trainer gets them passed on."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300, help="training steps per variant")
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (processes)")
    p.add_argument("--lag", type=int, default=4, help="steps the rollout policy lags behind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/demo", type=Path, help="output folder")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    p.add_argument("--no-sync", action="store_true", help="BAPO with sync_across_dp: false")
    p.add_argument("--update-docs", action="store_true", help="copy the figure into docs/")
    args = p.parse_args(argv)
    if args.steps < 1 or args.ranks < 1 or args.lag < 0:
        p.error("--steps and --ranks must be at least 1, --lag at least 0")
    return args


def main(argv=None) -> int:
    """Launch, collect, plot, judge; returns the exit status."""
    args, started = parse_args(argv), time.time()
    shutil.rmtree(args.out, ignore_errors=True)  # never report a previous run's numbers
    print(f"{args.ranks} gloo ranks, {', '.join(VARIANTS)}, {args.steps} steps each", flush=True)
    # 4 prompts x 8 per rank, 2 epochs of 2 micro-batches
    argv = ["--variants", ",".join(VARIANTS), "--out", args.out, "--seed", args.seed]
    argv += ["--steps", args.steps, "--lag", args.lag, "--prompts", 4, "--epochs", 2]
    argv += ["--mini-batches", 1, "--micro-batches", 2, "--eval-prompts", 16]
    argv += ["--no-sync"] if args.no_sync else []
    launch = torchrun(args.ranks, "scripts.harness.trainer", argv, args.timeout, sys.stdout)
    if launch.code != 0:
        what = "timed out" if launch.code is None else f"exited {launch.code}"
        print(f"the trainer {what}:\n{tail(launch.err)}", file=sys.stderr)
        return 3 if launch.code is None else 2
    rows = {name: report.load_rows(args.out / name / "metrics.jsonl") for name in VARIANTS}
    title = (
        f"tiny Llama in verl's FSDP2 engine, {args.ranks} ranks (gloo), task stop, GRPO groups "
        f"of 8, rollout policy {args.lag} steps stale, seed {args.seed}"
    )
    labels = {name: variant(name).label for name in VARIANTS}
    docs = "demo_report.png" if args.update_docs else None
    report.plot(
        {"demo": {n: [r] for n, r in rows.items()}}, labels, args.out / "report.png", title, docs
    )
    summaries = {name: report.run_summary(r) for name, r in rows.items()}
    checks = {
        k: all(s[k] for s in summaries.values()) for k in ("ranks_agree", "dp_group_forwarded")
    }
    keys = ("first_reward", "final_reward", "final_entropy", "moved_share", "mean_rho")
    result = {
        **checks,
        **{name: {k: s[k] for k in keys} for name, s in summaries.items()},
        "logprob_layout_max_err": max(s["logprob_layout_max_err"] or 0 for s in summaries.values()),
        "report": str(args.out / "report.png"),
        "wall_time_s": round(time.time() - started, 1),
    }
    print(json.dumps(result), flush=True)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
