"""`make experiment`: PPO, clip-higher, a fixed-pair ablation and three BAPO settings on stale data.

Each staleness level x seed is one launch of the trainer on one gloo rank, training the six
variants in turn; ``--workers`` launches at a time. Writes ``<out>/<level>/seed<k>/<variant>/``,
``table.md``, ``summary.json`` and ``report.png`` (``--update-docs`` copies the figure into
docs/). Each launch prints a progress line every ``--log-every`` steps, and the study one as
each launch ends; the last stdout line is one JSON object; exit 2 when a run did not finish.
"""

import argparse
import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Tuple

from scripts.harness import report
from scripts.harness.launch import tail, torchrun
from scripts.harness.variants import all_variants

# (steps the rollout policy lags, epochs over each batch). With two mini-batches a step,
# "stale" trains on data 8 to 11 optimizer updates old.
LEVELS = {"near_on_policy": (0, 1), "stale": (2, 2)}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; ``--quick`` shrinks the study to a smoke run."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--task", choices=("stop", "cover"), default="stop")
    p.add_argument("--steps", type=int, default=250, help="training steps per run")
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant and level")
    p.add_argument("--workers", type=int, default=2, help="launches trained in parallel")
    p.add_argument("--out", default="runs/experiment", type=Path, help="output folder")
    p.add_argument("--quick", action="store_true", help="6 steps, 2 seeds: a smoke run")
    p.add_argument("--update-docs", action="store_true", help="copy the figure into docs/")
    p.add_argument("--log-every", type=int, default=25, help="steps between progress lines")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per launch")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 6, 2
    if min(args.steps, args.seeds, args.workers) < 1:
        p.error("--steps, --seeds and --workers must be at least 1")
    return args


def launch(args, names, job: Tuple[str, int], ended: list) -> str:
    """Train every variant at one level and seed; return what went wrong ('' if nothing).

    Its progress lines stream to stdout; ``ended`` collects the launches' end times.
    """
    level, seed = job
    lag, epochs = LEVELS[level]
    out, tag = args.out / level / f"seed{seed}", f"{level}/seed{seed}"
    argv = ["--variants", ",".join(names), "--seed", seed, "--out", out, "--task", args.task]
    argv += ["--lag", lag, "--epochs", epochs, "--steps", args.steps, "--tag", tag]
    argv += ["--log-every", args.log_every]
    done = torchrun(1, "scripts.harness.trainer", argv, args.timeout, sys.stdout)
    ended.append(time.time())
    status = "timed out" if done.code is None else f"exited {done.code}"
    total, minutes = args.seeds * len(LEVELS), (ended[-1] - args.started) / 60
    left = minutes * (total - len(ended)) / len(ended)
    count = f"{len(ended)} of {total} launches ended"
    print(f"{tag}: {status}; {count} in {minutes:.1f} min, about {left:.0f} min left", flush=True)
    return "" if done.code == 0 else f"{tag} {status}:\n{tail(done.err)}"


def main(argv=None) -> int:
    """Train every run, then write the table, the summary, the figure and the JSON line."""
    args = parse_args(argv)
    args.started = started = time.time()
    shutil.rmtree(args.out, ignore_errors=True)  # never report a previous study's numbers
    labels = {v.name: v.label for v in all_variants()}
    jobs = [(level, seed) for level in LEVELS for seed in range(args.seeds)]
    print(f"{len(jobs)} launches of {len(labels)} variants -> {args.out}", flush=True)
    with ThreadPoolExecutor(args.workers) as pool:
        ended: list = []
        failures = [f for f in pool.map(lambda job: launch(args, labels, job, ended), jobs) if f]
    runs: dict = {level: {name: [] for name in labels} for level in LEVELS}
    for level, seed in jobs:
        for name in labels:
            path = args.out / level / f"seed{seed}" / name / "metrics.jsonl"
            rows = report.load_rows(path) if path.exists() else []
            if len(rows) != args.steps:
                failures.append(f"{path}: unfinished")
            runs[level][name].append(rows)
    if failures:
        print("\n".join(["runs that did not finish:"] + failures), file=sys.stderr)
        return 2
    summary = {lvl: {v: report.group_summary(runs[lvl][v]) for v in labels} for lvl in LEVELS}
    text = report.table(summary, labels)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    title = (
        f"task {args.task}: tiny Llama in verl's FSDP2 engine, GRPO groups of 8, {args.seeds} "
        "seeds, mean ± std; near_on_policy: rollout policy current, 1 epoch; stale: 2 steps "
        "behind, 2 epochs"
    )
    docs = f"experiment_report_{args.task}.png" if args.update_docs else None
    report.plot(runs, labels, args.out / "report.png", title, docs)
    print(text)
    keys = ("final_reward", "final_entropy", "moved_share", "collapsed_runs")
    first = next(iter(labels))
    result = {
        "variants": {
            lvl: {v: {k: s[k] for k in keys} for v, s in per.items()}
            for lvl, per in summary.items()
        },
        "neg_token_share": {lvl: per[first]["neg_token_share"] for lvl, per in summary.items()},
        "runs_finished": len(jobs) * len(labels),
        "task": args.task,
        "steps": args.steps,
        "seeds": args.seeds,
        "wall_time_s": round(time.time() - started, 1),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
