"""`make demo`, `make experiment`, `make sensitivity`: the one trainer's three jobs.

``demo``: PPO (0.8, 1.28) against BAPO's defaults on R gloo ranks (exit 1 if the ranks used
different pairs or the loss missed the engine's group); ``study``: five variants, two staleness
levels, several seeds; ``sensitivity``: one fixed mini-batch in micro-batches over 1 to 4 ranks.
Each writes only into a folder it makes (``scripts/harness/run_folder.py``): a new
``runs/<job>/<time>`` that ``runs/<job>/latest`` links to, or ``--out``, which must be new or
empty (``--update-docs`` copies the figure into docs/). It prints progress lines and ends with
one JSON line; exit 2 if a launch failed (3: the demo timed out). A signal ends every process it
started, then the job by it (``scripts/harness/owned_run.py``).
"""

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from scripts.harness import report, reproduce
from scripts.harness.launch import tail, torchrun
from scripts.harness.owned_run import owned_run
from scripts.harness.run_folder import claim
from scripts.harness.variants import all_variants, variant

# (steps the rollout policy lags, epochs over each batch). With two mini-batches a step,
# "stale" trains on data 8 to 11 optimizer updates old.
LEVELS = {"near_on_policy": (0, 1), "stale": (2, 2)}
DEMO = ("ppo_clip_higher", "bapo_paper")
FOLDERS = {"demo": "demo", "study": "experiment", "sensitivity": "sensitivity"}  # under runs/


def parse_args(argv=None) -> argparse.Namespace:
    """The three jobs' flags; ``study --quick`` shrinks the study to a smoke run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    jobs = p.add_subparsers(dest="job", required=True)
    demo, study, sens = (jobs.add_parser(job) for job in ("demo", "study", "sensitivity"))
    for job, steps in {demo: 300, study: 250, sens: 30}.items():
        job.add_argument("--steps", type=int, default=steps, help="training steps per run")
        job.add_argument("--out", type=Path, help="a new or empty folder (default: new, in runs/)")
        job.add_argument("--update-docs", action="store_true", help="copy the figure to docs/")
        job.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch")
    demo.add_argument("--ranks", type=int, default=2, help="data-parallel ranks")
    demo.add_argument("--lag", type=int, default=4, help="steps the rollout policy lags behind")
    study.add_argument("--task", choices=("stop", "cover"), default="stop")
    study.add_argument("--seeds", type=int, default=3, help="seeds per variant and level")
    study.add_argument("--workers", type=int, default=2, help="launches trained in parallel")
    study.add_argument("--quick", action="store_true", help="6 steps, 2 seeds: a smoke run")
    study.add_argument("--variants", default=",".join(v.name for v in all_variants()))
    study.add_argument("--levels", default=",".join(LEVELS), help="staleness levels trained")
    study.add_argument("--micro-batches", type=int, default=1, help="loss calls per update")
    sens.add_argument("--sequences", type=int, default=32, help="sequences in the mini-batch")
    sens.add_argument("--ranks", default="1,2,4", help="gloo rank counts")
    sens.add_argument("--micro", default="1,2,4,8", help="sequences per call and rank")
    args = p.parse_args(argv)
    if args.job == "study" and args.quick:
        args.steps, args.seeds = 6, 2
    if args.steps < 1 or min(getattr(args, key, 1) for key in ("seeds", "workers")) < 1:
        p.error("--steps, --seeds and --workers must be at least 1")
    known = {v.name for v in all_variants()}
    if args.job == "study" and not set(args.variants.split(",")) <= known:
        p.error(f"--variants takes names among {sorted(known)}, comma-separated")
    if args.job == "study" and not set(args.levels.split(",")) <= set(LEVELS):
        p.error(f"--levels takes names among {list(LEVELS)}, comma-separated")
    return args


def trainer(ranks: int, argv: list, args, tag: str) -> str:
    """One launch of the trainer, its progress lines on stdout; what went wrong ('' if nothing)."""
    done = torchrun(ranks, "scripts.harness.trainer", argv, args.timeout, sys.stdout)
    status = "timed out" if done.code is None else f"exited {done.code}"
    return "" if done.code == 0 else f"{tag} {status}:\n{tail(done.err)}"


def demo(args, started: float) -> int:
    """Both variants on the same seeds, 4 prompts x 8 per rank, 2 epochs of 2 micro-batches."""
    print(f"{args.ranks} gloo ranks, {', '.join(DEMO)}, {args.steps} steps each", flush=True)
    argv = ["--variants", ",".join(DEMO), "--out", args.out, "--steps", args.steps, "--lag"]
    argv += [args.lag, "--prompts", 4, "--epochs", 2, "--mini-batches", 1, "--micro-batches", 2]
    argv += ["--eval-prompts", 16]
    failure = trainer(args.ranks, argv, args, "demo")
    if failure:
        print(failure, file=sys.stderr)
        return 3 if " timed out:" in failure else 2
    rows = {name: report.load_rows(args.out / name / "metrics.jsonl") for name in DEMO}
    title = f"tiny Llama in verl's FSDP2 engine, {args.ranks} ranks (gloo), task stop, GRPO "
    title += f"groups of 8, rollout policy {args.lag} steps stale"
    labels, docs = {name: variant(name).label for name in DEMO}, "demo_report.png"
    runs = {"demo": {n: [r] for n, r in rows.items()}}
    report.plot(runs, labels, args.out / "report.png", title, docs if args.update_docs else None)
    summaries = [report.run_summary(rows[name], report.last_pair(name)) for name in DEMO]
    checks = {k: all(s[k] for s in summaries) for k in ("ranks_agree", "dp_group_forwarded")}
    keys = ["first_reward", "final_reward", "final_entropy", "moved_share", "mean_rho"]
    keys += [*report.OUTCOMES, "outcome_sum"]
    result = {**checks, **{n: {k: s[k] for k in keys if k in s} for n, s in zip(DEMO, summaries)}}
    files = {name: args.out / name / "metrics.jsonl" for name in DEMO}
    verdicts = reproduce.compare(files, {"ranks": args.ranks, "lag": args.lag})
    print(reproduce.sentence(verdicts), flush=True)
    result["reproduced"] = verdicts
    result.update(report=str(args.out / "report.png"), wall_time_s=round(time.time() - started, 1))
    print(json.dumps(result), flush=True)
    return 0 if all(checks.values()) else 1


def study(args, started: float) -> int:
    """Train every run, then write the table, the summary, the figure and the JSON line."""
    chosen, levels = args.variants.split(","), args.levels.split(",")
    labels = {v.name: v.label for v in all_variants() if v.name in chosen}
    jobs = [(level, seed) for level in levels for seed in range(args.seeds)]
    print(f"{len(jobs)} launches of {len(labels)} variants", flush=True)
    failures: list = []
    with ThreadPoolExecutor(args.workers) as pool:
        futures = {}
        for level, seed in jobs:
            tag, out = f"{level}/seed{seed}", args.out / level / f"seed{seed}"
            argv = ["--variants", ",".join(labels), "--seed", seed, "--out", out, "--task"]
            argv += [args.task, "--steps", args.steps, "--tag", tag, "--log-every", 25]
            argv += ["--lag", LEVELS[level][0], "--epochs", LEVELS[level][1]]
            argv += ["--micro-batches", args.micro_batches]
            futures[pool.submit(trainer, 1, argv, args, tag)] = tag
        # the estimate of the time left: the mean time per launch so far, for those not ended
        for count, future in enumerate(as_completed(futures), 1):
            minutes = (time.time() - started) / 60
            left = minutes * (len(jobs) - count) / count
            ends = f"{count} of {len(jobs)} launches ended in {minutes:.1f} min"
            print(f"{futures[future]}: {ends}, about {left:.0f} min left", flush=True)
            failures += [future.result()] if future.result() else []
    runs: dict = {level: {name: [] for name in labels} for level in levels}
    for level, seed in jobs:
        for name in labels:
            path = args.out / level / f"seed{seed}" / name / "metrics.jsonl"
            rows = report.load_rows(path) if path.exists() else []
            failures += [] if len(rows) == args.steps else [f"{path}: unfinished"]
            runs[level][name].append(rows)
    if failures:
        print("\n".join(["runs that did not finish:"] + failures), file=sys.stderr)
        return 2
    summary = {
        level: {v: report.group_summary(runs[level][v], report.last_pair(v)) for v in labels}
        for level in levels
    }
    text = report.table(summary, labels)
    (args.out / "table.md").write_text(text + "\n")
    title = f"task {args.task}: tiny Llama in verl's FSDP2 engine, GRPO groups of 8, {args.seeds} "
    title += "seeds, mean ± std; near_on_policy: rollout policy current, 1 epoch; stale: 2 steps "
    title += f"behind, 2 epochs; {args.micro_batches} loss calls per update"
    docs = f"experiment_report_{args.task}.png" if args.update_docs else None
    report.plot(runs, labels, args.out / "report.png", title, docs)
    print(text)
    keys = ["final_reward", "final_entropy", "moved_share", "collapsed_runs", *report.OUTCOMES]
    keys += ["outcome_sum", "lower_phase"]  # the last three for BAPO only
    result: dict = {"variants": {}, "neg_token_share": {}, "task": args.task}
    result["micro_batches"] = args.micro_batches
    for level, per in summary.items():
        result["variants"][level] = {v: {k: s[k] for k in keys if k in s} for v, s in per.items()}
        result["neg_token_share"][level] = per[next(iter(labels))]["neg_token_share"]
    result["runs_finished"] = len(jobs) * len(labels)
    result.update(steps=args.steps, seeds=args.seeds, wall_time_s=round(time.time() - started, 1))
    print(json.dumps(result), flush=True)
    return 0


def distances(split: dict, ranks: int) -> dict:
    """A split's calls against the reference pair: their pairs, mean |dc| per bound, same pair."""
    (low, high), calls = split["reference"], split["pairs"]
    counts = Counter(f"({a:.2f}, {b:.2f})" for a, b in calls).most_common()
    row = {"ranks": ranks, "micro": split["micro"], "scope": split["scope"], "calls": len(calls)}
    row.update(reference=f"({low:.2f}, {high:.2f})", ranks_agree=split["ranks_agree"])
    row["pairs"] = ", ".join(f"{pair} x{n}" for pair, n in counts)
    row["d_low"] = sum(abs(a - low) for a, _ in calls) / len(calls)
    row["d_high"] = sum(abs(b - high) for _, b in calls) / len(calls)
    row["distance"] = row["d_low"] + row["d_high"]
    row["same_pair"] = sum([a, b] == [low, high] for a, b in calls) / len(calls)
    return row


def sensitivity(args, started: float) -> int:
    """Make the data (a stale BAPO run on ``cover``), replay it on each rank count, report."""
    fixed = args.out / "data" / "bapo_paper" / "fixed.pt"
    argv = ["--variants", "bapo_paper", "--out", args.out / "data", "--task", "cover", "--lag", 2]
    launches = [(1, [*argv, "--epochs", 2, "--steps", args.steps, "--dump", "--tag", "data"])]
    for ranks in map(int, args.ranks.split(",")):
        argv = ["--replay", fixed, "--out", args.out / f"ranks{ranks}.json", "--micro", args.micro]
        launches.append((ranks, [*argv, "--sequences", args.sequences]))
    for ranks, argv in launches:
        failure = trainer(ranks, argv, args, f"{ranks} ranks")
        print(f"launch on {ranks} ranks ended: {(time.time() - started) / 60:.1f} min", flush=True)
        if failure:
            print(failure, file=sys.stderr)
            return 2
    records = [json.loads(path.read_text()) for path in sorted(args.out.glob("ranks*.json"))]
    rows = [distances(split, record["ranks"]) for record in records for split in record["splits"]]
    text = report.sensitivity_table(rows)
    (args.out / "table.md").write_text(text + "\n")
    report.sensitivity_plot(rows, args.out / "sensitivity.png", args.update_docs)
    print(text)
    print(json.dumps({"splits": rows, "wall_time_s": round(time.time() - started, 1)}), flush=True)
    return 0


def main(argv=None) -> int:
    """Run one job in a folder it makes now: no earlier run's numbers are read, none are lost."""
    args = parse_args(argv)
    with owned_run():
        args.out = claim(args.out, FOLDERS[args.job])
        print(f"writing under {args.out}", flush=True)
        job = {"demo": demo, "study": study, "sensitivity": sensitivity}[args.job]
        return job(args, time.time())


if __name__ == "__main__":
    sys.exit(main())
