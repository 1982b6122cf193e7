"""`make experiment`: PPO, clip-higher, a fixed-pair ablation and three BAPO settings on stale data.

Every variant x seed x staleness level is one run of the harness trainer (verl's engine, one gloo
rank) on the same seeds and data order, ``--workers`` runs at a time. Writes
``<out>/<level>/<variant>/seed<k>/metrics.jsonl``, ``table.md``, ``summary.json`` and
``report.png`` (copied to ``docs/experiment_report_<task>.png`` unless ``--quick`` or
``--no-docs``); the last stdout line is one JSON object. Exit status 2 when a run did not finish.
Run: python -m scripts.experiment [--task stop|cover] [--quick]
"""

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from scripts.harness import report

ROOT = Path(__file__).resolve().parents[1]
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
    p.add_argument("--workers", type=int, default=2, help="runs trained in parallel")
    p.add_argument("--out", default="runs/experiment", type=Path, help="output folder")
    p.add_argument("--quick", action="store_true", help="6 steps, 2 seeds: a smoke run")
    p.add_argument("--no-docs", action="store_true", help="do not copy the figure to docs/")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds before giving up")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 6, 2
    if min(args.steps, args.seeds, args.workers) < 1:
        p.error("--steps, --seeds and --workers must be at least 1")
    return args


def init_worker() -> None:
    """Per process: one torch thread, a one-rank gloo group, the patched Trinity required."""
    import os
    import warnings

    import torch
    import torch.distributed as dist

    from scripts.harness.trainer import require_patched_trinity

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    require_patched_trinity()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def run_one(name: str, seed: int, level: str, task: str, steps: int, out: str) -> dict:
    """Train one run in a pool process."""
    from scripts.harness.trainer import Setting, train
    from scripts.harness.variants import variant

    lag, epochs = LEVELS[level]
    return train(variant(name), seed, Setting(task, lag, epochs, steps), Path(out))


def train_all(args, jobs) -> list:
    """Train every (level, variant, seed, folder) job; return what did not finish."""
    failures = []
    pool = ProcessPoolExecutor(args.workers, mp.get_context("spawn"), initializer=init_worker)
    futures = {
        pool.submit(run_one, v, s, lvl, args.task, args.steps, str(where)): (lvl, v, s)
        for lvl, v, s, where in jobs
    }
    try:
        for done, future in enumerate(as_completed(futures, timeout=args.timeout), 1):
            what = "{} {} seed {}".format(*futures[future])
            try:
                print(f"[{done}/{len(jobs)}] {what}: {future.result()['wall_s']} s", flush=True)
            except Exception as exc:  # report every failed run, keep the others going
                failures.append(f"{what}: {exc!r}")
    except TimeoutError:
        failures.append(f"study timed out after {args.timeout:.0f} s")
        for process in getattr(pool, "_processes", {}).values():  # no public way to stop a run
            process.terminate()
    pool.shutdown(cancel_futures=True)
    return failures


def main(argv=None) -> int:
    """Train every run, then write the table, the summary, the figure and the JSON line."""
    from scripts.harness.variants import all_variants

    args, started = parse_args(argv), time.time()
    shutil.rmtree(args.out, ignore_errors=True)  # never report a previous study's numbers
    labels = {v.name: v.label for v in all_variants()}
    seeds = range(args.seeds)
    jobs = [
        (lvl, v, s, args.out / lvl / v / f"seed{s}")
        for lvl in LEVELS
        for s in seeds
        for v in labels
    ]
    print(f"{len(jobs)} runs ({len(labels)} variants, {args.seeds} seeds, 2 levels)", flush=True)
    failures = train_all(args, jobs)
    runs: dict = {lvl: {v: [] for v in labels} for lvl in LEVELS}
    for lvl, v, _, where in jobs:
        path = where / "metrics.jsonl"
        rows = report.load_rows(path) if path.exists() else []
        if len(rows) == args.steps:
            runs[lvl][v].append(rows)
        else:
            failures.append(f"{where}: unfinished")
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
    report.plot(runs, labels, args.out / "report.png", title)
    if not (args.quick or args.no_docs):
        shutil.copyfile(
            args.out / "report.png", ROOT / "docs" / f"experiment_report_{args.task}.png"
        )
    print(text)
    keys = ("final_reward", "final_entropy", "moved_share", "collapsed_runs")
    first = next(iter(labels))
    result = {
        "variants": {
            lvl: {v: {k: s[k] for k in keys} for v, s in per.items()}
            for lvl, per in summary.items()
        },
        "neg_token_share": {lvl: per[first]["neg_token_share"] for lvl, per in summary.items()},
        "runs_finished": len(jobs),
        "task": args.task,
        "steps": args.steps,
        "seeds": args.seeds,
        "wall_time_s": round(time.time() - started, 1),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
