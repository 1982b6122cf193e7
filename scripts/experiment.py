"""`make experiment`: PPO, clip-higher, a fixed-pair ablation and three BAPO settings on stale data.

Every variant x seed x staleness level is one run of the harness trainer (verl's engine, one
gloo rank), on the same seeds and data order. Runs go to a pool of processes (two at a time by
default, one torch thread each, a one-rank process group per process). Writes
``<out>/<level>/<variant>/seed<k>/metrics.jsonl``, ``<out>/table.md``, ``<out>/summary.json``
and ``<out>/report.png`` (copied to ``docs/experiment_report_<task>.png`` unless ``--quick``
or ``--no-docs``); the last stdout line is one JSON object.
Run: python -m scripts.experiment [--task stop|cover] [--quick]

Exit status: 0 when every run finished, 2 when one failed or the study timed out.
"""

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, TimeoutError, as_completed
from pathlib import Path

from scripts.harness import report

ROOT = Path(__file__).resolve().parents[1]
# Staleness levels: (training steps the rollout policy lags, epochs over each batch). With two
# mini-batches a step, "stale" trains on data 8 to 11 optimizer updates old.
LEVELS = {"near_on_policy": (0, 1), "stale": (2, 2)}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; ``--quick`` shrinks the study to a smoke run."""
    p = argparse.ArgumentParser(
        description="BAPO against fixed clipping on stale, negative-dominated data (CPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--task", choices=("stop", "cover"), default="stop")
    p.add_argument("--steps", type=int, default=250, help="training steps per run")
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant and level")
    p.add_argument("--workers", type=int, default=2, help="runs trained in parallel")
    p.add_argument("--out", default="runs/experiment", help="output folder")
    p.add_argument("--quick", action="store_true", help="6 steps, 2 seeds: a smoke run")
    p.add_argument("--no-docs", action="store_true", help="do not copy the figure to docs/")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds before giving up")
    p.add_argument("--resume", action="store_true", help="train only the unfinished runs")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 6, 2
    for name in ("steps", "seeds", "workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def init_worker() -> None:
    """Per process: one torch thread, a one-rank gloo group, the patched Trinity required."""
    import os
    import warnings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from scripts.harness.trainer import require_patched_trinity

    require_patched_trinity()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def run_one(name: str, seed: int, level: str, task: str, steps: int, out: str) -> dict:
    """Train one run in a pool process."""
    from scripts.harness.trainer import Setting, train
    from scripts.harness.variants import variant

    lag, epochs = LEVELS[level]
    setting = Setting(task=task, lag=lag, epochs=epochs, steps=steps)
    return train(variant(name), seed, setting, Path(out))


def run_dir(out: Path, level: str, variant: str, seed: int) -> Path:
    """Where one run writes its metrics."""
    return out / level / variant / f"seed{seed}"


def finished(where: Path, steps: int) -> bool:
    """Whether a run wrote all its steps."""
    path = where / "metrics.jsonl"
    return path.exists() and len(path.read_text().splitlines()) == steps


def train_all(args, names, out: Path, started: float) -> list:
    """Every run, ``args.workers`` at a time; returns the failures (empty when all finished)."""
    jobs = [(v, s, lvl) for lvl in LEVELS for s in range(args.seeds) for v in names]
    if args.resume:
        jobs = [job for job in jobs if not finished(run_dir(out, job[2], *job[:2]), args.steps)]
    failures = []
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=init_worker) as pool:
        futures = {
            pool.submit(run_one, v, s, lvl, args.task, args.steps, str(run_dir(out, lvl, v, s))): (
                v,
                s,
                lvl,
            )
            for v, s, lvl in jobs
        }
        try:
            for done, fut in enumerate(as_completed(futures, timeout=args.timeout), 1):
                v, s, lvl = futures[fut]
                try:
                    wall = fut.result()["wall_s"]
                    print(f"[{done}/{len(jobs)}] {lvl} {v} seed {s}: {wall} s", flush=True)
                except Exception as exc:  # report every failed run, keep the others going
                    failures.append(f"{lvl} {v} seed {s}: {exc!r}")
                    print(f"[{done}/{len(jobs)}] FAILED {failures[-1]}", flush=True)
        except TimeoutError:
            failures.append(f"study timed out after {args.timeout:.0f} s")
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
    return failures


def main(argv=None) -> int:
    """Train every run, then write the table, the summary, the figure and the JSON line."""
    from scripts.harness.variants import all_variants

    args = parse_args(argv)
    started = time.time()
    out = Path(args.out)
    if not args.resume:
        shutil.rmtree(out, ignore_errors=True)  # never report a previous study's numbers
    out.mkdir(parents=True, exist_ok=True)
    labels = {v.name: v.label for v in all_variants()}
    names = list(labels)
    print(f"{len(names)} variants x {args.seeds} seeds x {len(LEVELS)} levels -> {out}", flush=True)
    failures = train_all(args, names, out, started)
    every = [(lvl, v, s) for lvl in LEVELS for s in range(args.seeds) for v in names]
    failures += [
        f"{run_dir(out, *job)}: unfinished"
        for job in every
        if not finished(run_dir(out, *job), args.steps)
    ]
    if failures:
        print("\n".join(["runs that did not finish:"] + failures), file=sys.stderr)
        return 2
    runs = {
        lvl: {
            v: [
                report.load_rows(run_dir(out, lvl, v, s) / "metrics.jsonl")
                for s in range(args.seeds)
            ]
            for v in names
        }
        for lvl in LEVELS
    }
    summary = {lvl: {v: report.group_summary(runs[lvl][v]) for v in names} for lvl in LEVELS}
    text = report.table(summary, labels)
    (out / "table.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    title = (
        f"task {args.task}: tiny Llama in verl's FSDP2 engine, GRPO groups of 8, {args.seeds} "
        "seeds, mean ± std; near_on_policy: rollout policy current, 1 epoch; stale: 2 steps "
        "behind, 2 epochs"
    )
    report.plot(runs, labels, out / "report.png", title)
    if not (args.quick or args.no_docs):
        shutil.copyfile(out / "report.png", ROOT / "docs" / f"experiment_report_{args.task}.png")
    print(text)
    keys = ("final_reward", "final_entropy", "moved_share")
    result = {
        "variants": {
            lvl: {
                v: {k: s[k] for k in keys} | {"collapsed_runs": s["collapsed_runs"]}
                for v, s in per.items()
            }
            for lvl, per in summary.items()
        },
        "neg_token_share": {lvl: per[names[0]]["neg_token_share"] for lvl, per in summary.items()},
        "runs_finished": len(every),
        "task": args.task,
        "steps": args.steps,
        "seeds": args.seeds,
        "wall_time_s": round(time.time() - started, 1),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
