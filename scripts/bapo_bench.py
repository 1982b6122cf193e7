"""Benchmark BAPO's bound search against PPO and against a per-candidate loop.

Prints a readable report and, as its last stdout line, one JSON object with the five figures
(see ``TARGETS``) and the pair checks. Not a test: nothing here asserts on time. Sizes:

* loss forward: 64 x 1024 tokens (65,536), paper hyper-parameters, data on which rho0 = 0.4 is
  never met so Algorithm 1 walks all 51 steps (checked through ``bapo_search_steps``);
* search vs literal loop: the same tokens, single process;
* data parallel: 4 gloo ranks under torchrun, 16,384 tokens each (subprocess with a timeout);
* memory: 2,000,000 tokens and a 2,000-candidate grid, in a fresh subprocess;
* steady heap (information): the loss forward again in a child whose glibc keeps freed memory
  (``STEADY_HEAP``). With its defaults glibc can hand freed token-sized blocks (>= 128 KiB)
  back to the OS, so a fresh temporary pays page faults on first touch, which a caching
  allocator (as CUDA's) avoids. The required figure stays the default-environment one.

``--quick`` shrinks every size (for the smoke test), ``--scaling`` adds the scaling tables,
``--profile`` prints full torch.profiler tables. Timing: interleaved repeats, medians; on CPU
the clock is the calling thread's CPU time (``time.thread_time``) with one torch thread, which
other processes on the same cores disturb far less than wall time (wall medians are printed
next to it); on CUDA, and for the multi-process figures, wall time.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench import cuda as bench_cuda  # noqa: E402
from bench import machine  # noqa: E402
from bench.inputs import (  # noqa: E402
    CANDIDATE_GRIDS,
    PAPER,
    PAPER_PATH_STEPS,
    grid_kwargs,
    make_batch,
    ratio_of,
)
from bench.literal import literal_search, surrogate_share  # noqa: E402

# key: (label, target, limit, higher_is_better)
TARGETS = {
    "bapo_over_ppo_loss": ("BAPO / PPO loss forward", 2.0, 3.0, False),
    "speedup_vs_literal_loop": ("literal loop / our search", 3.0, 2.0, True),
    "dp_speedup_vs_per_candidate_allreduce": ("DP per-candidate / ours", 10.0, 5.0, True),
    "collectives_per_call": ("collectives per synced call", 1, 1, None),
    # the header (2) and the paper grid's 16 + 37 candidates
    "all_reduce_values_per_call": ("values per synced all-reduce", 55, 55, None),
    "large_grid_peak_rss_over_input": ("peak RSS growth / input", 8.0, None, False),
}
SIZES: Dict[str, Dict[str, Any]] = {
    "full": dict(
        loss_shape=(64, 1024),
        repeats=31,
        dp_tokens=16384,
        dp_repeats=15,
        rss_tokens=2_000_000,
        mid_shape=(8, 1024),
        dp_timeout=420,
        rss_timeout=300,
        loss_timeout=300,
    ),
    "quick": dict(
        loss_shape=(4, 256),
        repeats=5,
        dp_tokens=1024,
        dp_repeats=3,
        rss_tokens=50_000,
        mid_shape=(2, 256),
        dp_timeout=150,
        rss_timeout=60,
        loss_timeout=120,
    ),
}
# glibc keeps every block under 1 GiB in its heap and never trims it: freed buffers are reused
# without new page faults, like a caching allocator.
STEADY_HEAP = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
STEADY_HEAP_NOTE = (
    "steady heap: same timing in a child with MALLOC_{MMAP,TRIM}_THRESHOLD_=1 GiB, so freed "
    "buffers are reused without page faults (like a caching allocator); not a target"
)


def say(line: str = "") -> None:
    """Print one line of the report at once."""
    print(line, flush=True)


class Clock:
    """Thread CPU time on CPU with one torch thread; wall time otherwise."""

    def __init__(self, device: str, threads: int):
        """Choose the clock for ``device`` and the number of torch threads."""
        self.cpu = device == "cpu" and threads == 1
        self.name = "thread CPU time" if self.cpu else "wall time"
        self.device = device

    def sync(self) -> None:
        """Wait for queued CUDA work, so that a sample covers it."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def measure(self, contenders: Dict[str, Callable], repeats: int, warmup: int = 2) -> Dict:
        """Interleaved samples: {name: (median on this clock, median wall)} in seconds."""
        names = list(contenders)
        for _ in range(warmup):
            for name in names:
                contenders[name]()
        self.sync()
        samples: Dict[str, Tuple[List[float], List[float]]] = {n: ([], []) for n in names}
        for i in range(repeats):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                self.sync()
                w0, c0 = time.perf_counter(), time.thread_time()
                contenders[name]()
                self.sync()
                c1, w1 = time.thread_time(), time.perf_counter()
                samples[name][0].append(c1 - c0 if self.cpu else w1 - w0)
                samples[name][1].append(w1 - w0)
        return {n: (statistics.median(a), statistics.median(b)) for n, (a, b) in samples.items()}


def faults_per_call(fn: Callable, calls: int = 9) -> int:
    """Median minor page faults of one call: what a fresh, OS-backed buffer costs on CPU."""
    counts = []
    for _ in range(calls):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return int(statistics.median(counts))


def fmt_ms(seconds: float) -> str:
    """Format seconds as right-aligned milliseconds."""
    return f"{seconds * 1e3:9.3f} ms"


def loss_classes():
    """Import the two loss classes once torch threads are set."""
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
    from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn

    return BAPOPolicyLossFn, PPOPolicyLossFn


# ----------------------------------------------------------------------------- loss vs PPO
def bench_loss(clock: Clock, shape, repeats: int, device: str) -> Dict:
    """BAPO forward vs PPO forward on one micro-batch (log-probs require grad, as in training)."""
    BAPO, PPO = loss_classes()
    bapo, ppo = BAPO(**PAPER), PPO(clip_range=0.2)
    batch = make_batch(shape, seed=0, device=device, requires_grad=True)
    _, metrics = bapo(**batch)
    times = clock.measure({"bapo": lambda: bapo(**batch), "ppo": lambda: ppo(**batch)}, repeats)
    say(
        f"## Loss forward on {shape[0]} x {shape[1]} = {batch['logprob'].numel():,} tokens "
        f"({device}; {clock.name}; median of {repeats}, interleaved)"
    )
    say(
        f"   bapo_search_steps = {metrics['bapo_search_steps']} (paper path: "
        f"{PAPER_PATH_STEPS}), target met = {bool(metrics['bapo_target_met'])}, "
        f"rho = {metrics['bapo_positive_contribution']:.4f}, pair = "
        f"({metrics['bapo_clip_low']}, {metrics['bapo_clip_high']})"
    )
    faults = {
        "bapo": faults_per_call(lambda: bapo(**batch)),
        "ppo": faults_per_call(lambda: ppo(**batch)),
    }
    for name, label in (
        ("ppo", "PPOPolicyLossFn (clip_range 0.2)"),
        ("bapo", "BAPOPolicyLossFn (paper defaults)"),
    ):
        cpu, wall = times[name]
        say(
            f"   {label:46s} {fmt_ms(cpu)}   (wall {fmt_ms(wall)}; "
            f"{faults[name]} minor faults/call)"
        )

    def forward_backward(fn):
        batch["logprob"].grad = None
        fn(**batch)[0].backward()

    both = clock.measure(
        {"bapo": lambda: forward_backward(bapo), "ppo": lambda: forward_backward(ppo)},
        repeats,
    )
    say(
        f"   forward + backward (info): BAPO {fmt_ms(both['bapo'][0]).strip()}, PPO "
        f"{fmt_ms(both['ppo'][0]).strip()}, ratio {both['bapo'][0] / both['ppo'][0]:.2f}"
    )
    return {
        "ratio": times["bapo"][0] / times["ppo"][0],
        "fwd_bwd_ratio": both["bapo"][0] / both["ppo"][0],
        "steps": metrics["bapo_search_steps"],
        "target_met": bool(metrics["bapo_target_met"]),
        "ms": {k: v[0] * 1e3 for k, v in times.items()},
        "minor_faults_per_call": faults,
    }


def bench_stages(clock: Clock, shape, repeats: int, device: str) -> Dict:
    """Time the stages of one BAPO forward.

    The stages of ``BAPOPolicyLossFn.__call__`` in its order, each timed apart on the previous
    stage's outputs (same inputs, interleaved).
    """
    from trinity.algorithm.utils import masked_mean

    BAPO, _ = loss_classes()
    bapo = BAPO(**PAPER)
    search = bapo.search
    batch = make_batch(shape, seed=0, device=device, requires_grad=True)
    lp, old, adv, am = (batch[k] for k in ("logprob", "old_logprob", "advantages", "action_mask"))
    raw = lp - old
    log_ratio = torch.clamp(raw, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    finite = torch.isfinite(raw.detach() + adv)
    sums = search.local_sums(ratio, adv, am, finite)
    choice = search.decide(sums)

    def clipped_loss_and_metrics():
        loss, _ = bapo._clipped_loss(ratio, adv, am, choice.clip_low, choice.clip_high)
        masked_mean(-log_ratio, am).detach().item()  # ppo_kl
        return loss.detach().item()  # pg_loss

    stages = {
        "ratio (sub, clamp, exp; PPO does the same)": lambda: torch.exp(
            torch.clamp(lp - old, min=-20.0, max=20.0)
        ),
        "finite: isfinite((lp - old) + adv)": lambda: torch.isfinite(raw.detach() + adv),
        "local_sums (bucketize, 2 bincounts)": lambda: search.local_sums(ratio, adv, am, finite),
        "decide (host walk over the sums)": lambda: search.decide(sums),
        "clipped loss + metrics (.item() x4)": clipped_loss_and_metrics,
    }
    times = clock.measure(stages, repeats)
    total = sum(v[0] for v in times.values())
    say(
        f"## Where a BAPO forward spends its time ({clock.name}, stages timed apart, median of "
        f"{repeats}; % of their sum)"
    )
    for name, (cpu, _) in times.items():
        say(f"   {name:46s} {fmt_ms(cpu)}  {100 * cpu / total:5.1f}%")
    say(f"   {'sum of the stages':46s} {fmt_ms(total)}")
    return {name: v[0] * 1e3 for name, v in times.items()}


def profile_tables(shape, rows: int) -> None:
    """torch.profiler self-CPU tables for BAPO and PPO (wall-clock based, so noisy here)."""
    from torch.profiler import ProfilerActivity, profile

    BAPO, PPO = loss_classes()
    batch = make_batch(shape, seed=0, requires_grad=True)
    for label, fn in (("BAPO", BAPO(**PAPER)), ("PPO", PPO(clip_range=0.2))):
        for _ in range(3):
            fn(**batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                fn(**batch)
        say(f"## torch.profiler, {label}, 10 forwards, top {rows} ops by self CPU time")
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        for line in table.splitlines():
            say("   " + line)


# ----------------------------------------------------------------------- search vs literal
def pair_of(result) -> tuple:
    """Return (clip_low, clip_high, steps) of a search result."""
    return (result.clip_low, result.clip_high, result.steps)


def mid_path_check(shape) -> Dict:
    """Check the same pair when the target is met mid-path.

    The target is set halfway between rho at steps 9 and 10 of the upper phase, so the literal
    loop and our search must both stop at step 10. (tests/test_bench_smoke.py pins the literal
    loop to the Algorithm 1 oracle.)
    """
    BAPO, _ = loss_classes()
    batch = make_batch(shape, seed=7)
    ratio, finite = ratio_of(batch)
    adv, mask = batch["advantages"], batch["action_mask"]
    rho = [surrogate_share(ratio, adv, mask, 0.6, 1.2 + 0.05 * k) for k in (9, 10)]
    if not rho[0] < rho[1]:
        return {"ok": False, "why": f"rho not increasing at step 10: {rho}"}
    grid = dict(PAPER, positive_contribution_target=(rho[0] + rho[1]) / 2)
    literal = literal_search(ratio, adv, mask, grid)
    search = BAPO(**grid).search
    ours = pair_of(search.decide(search.local_sums(ratio, adv, mask, finite)))
    ok = literal == ours and ours[2] == 10
    return {"ok": ok, "literal": literal, "ours": ours}


def bench_search(clock: Clock, shape, repeats: int, device: str, mid_shape) -> Dict:
    """Our search (local_sums + decide) vs the per-candidate loop."""
    BAPO, _ = loss_classes()
    search = BAPO(**PAPER).search
    batch = make_batch(shape, seed=0, device=device)
    adv, mask = batch["advantages"], batch["action_mask"]
    ratio, finite = ratio_of(batch)
    bmask = mask.bool()
    ours = lambda: search.decide(search.local_sums(ratio, adv, bmask, finite))  # noqa: E731
    literal = lambda: literal_search(ratio, adv, mask, PAPER)  # noqa: E731
    times = clock.measure({"literal": literal, "ours": ours}, repeats)
    lit_pair, our_pair = literal(), pair_of(ours())
    say(
        f"## Search vs the per-candidate literal loop, {ratio.numel():,} tokens ({device}, "
        f"{clock.name}, median of {repeats})"
    )
    say("   timed, from (ratio, advantages, mask) in hand: ours = BoundSearch.local_sums +")
    say("   decide (finite mask precomputed, as the loss makes it next to the ratio); literal =")
    say("   sign masks + for each pair on the path one pass for P, N and one .item()")
    for name, label in (
        ("literal", f"literal per-candidate loop ({lit_pair[2] + 1} passes)"),
        ("ours", "ours: local_sums + decide"),
    ):
        cpu, wall = times[name]
        say(f"   {label:46s} {fmt_ms(cpu)}   (wall {fmt_ms(wall)})")
    mid = mid_path_check(mid_shape) if device == "cpu" else {"ok": True, "skipped": "cpu only"}
    same = lit_pair == our_pair and mid["ok"]
    say(f"   pairs: literal {lit_pair}, ours {our_pair}")
    say(f"   mid-path target check (literal / ours stop at step 10): {mid}")
    return {
        "speedup": times["literal"][0] / times["ours"][0],
        "same_pair": same,
        "pairs": {"literal": lit_pair, "ours": our_pair},
        "mid_path": mid,
        "ms": {k: v[0] * 1e3 for k, v in times.items()},
    }


# ------------------------------------------------------------------------- subprocesses
def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Return the environment of a benchmark child: one thread, unbuffered output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def bench_dp(tokens: int, repeats: int, timeout: int) -> Dict:
    """4 gloo ranks under torchrun; the worker writes its JSON to a temp file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dp.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=4",
            os.path.join(HERE, "bench", "dp_worker.py"),
            "--out",
            out,
            "--tokens-per-rank",
            str(tokens),
            "--repeats",
            str(repeats),
        ]
        try:
            proc = subprocess.run(
                cmd, env=child_env(), timeout=timeout, capture_output=True, text=True
            )
        except subprocess.TimeoutExpired:
            return {"error": f"torchrun timed out after {timeout} s"}
        if proc.returncode != 0 or not os.path.exists(out):
            return {"error": f"torchrun exit {proc.returncode}: {proc.stderr[-2000:]}"}
        with open(out) as f:
            result = json.load(f)
    say(
        f"## Data parallel: {result['world_size']} gloo ranks x {result['tokens_per_rank']:,} "
        f"tokens (wall time per call over {result['calls_per_repeat']} back-to-back calls, "
        f"slowest rank per repeat, median of {result['repeats']})"
    )
    med = result["median_s"]
    say(f"   per candidate (all_reduce [P, N] + .item() per pair)  {fmt_ms(med['literal'])}")
    say(f"   ours (local_sums + one all_reduce + decide)          {fmt_ms(med['ours'])}")
    say(f"   whole BAPO forward with dp_group (info)               {fmt_ms(med['loss'])}")
    say(
        f"   collectives per call: {result['collectives']} (after the first call, which also "
        "all-gathers each rank's settings once)"
    )
    say(
        f"   pairs: literal {result['literal_pair']}, ours {result['ours_pair']}, one process "
        f"on the union {result['union_pair']}, all ranks agree: {result['ranks_agree']}"
    )
    return result


def bench_loss_steady_heap(args, timeout: int) -> Dict:
    """The loss forward again in a child started with ``STEADY_HEAP``; echoes its section."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--loss-only",
        "--threads",
        str(args.threads),
    ] + ["--quick"] * args.quick
    if args.repeats:
        cmd += ["--repeats", str(args.repeats)]
    env = child_env(STEADY_HEAP)
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"steady-heap child timed out after {timeout} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"steady-heap child exit {proc.returncode}: {proc.stderr[-1500:]}"}
    say("## Steady heap (information): " + ", ".join(f"{k}={v}" for k, v in STEADY_HEAP.items()))
    for line in lines[:-1]:
        say(line.replace("## ", "   ", 1) if line.startswith("## ") else line)
    return result


def bench_rss(tokens: int, timeout: int, info: bool = True) -> Dict:
    """Peak RSS growth of one search in a fresh process (plus the whole loss, as information)."""
    env = child_env({"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "0"})
    runs = {}
    for mode in ("search", "loss") if info else ("search",):
        cmd = [
            sys.executable,
            os.path.join(HERE, "bench", "rss_probe.py"),
            "--tokens",
            str(tokens),
            "--grid",
            "2000",
            "--mode",
            mode,
        ]
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
            runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as err:
            runs[mode] = {"error": repr(err)[:500]}
    main = runs["search"]
    if "error" in main:
        say(f"## Peak RSS: failed: {main['error']}")
        return {"error": main["error"], "runs": runs}
    say(
        f"## Peak RSS growth, {main['tokens']:,} tokens, {main['candidates']} candidates "
        f"(search walks {main['steps']} steps); inputs {main['input_bytes'] / 2**20:.1f} MiB "
        f"(logprob, old_logprob, advantages float32; mask bool)"
    )
    how = "reset by /proc/self/clear_refs" if main["peak_reset"] else "NOT reset (underestimate)"
    say(f"   high-water mark {how}; glibc trimming forced so freed memory leaves RSS")
    for key, label in (
        ("search", "one search: local_sums + decide"),
        ("loss", "whole loss forward (info)"),
    ):
        r = runs.get(key)
        if r is None:
            continue
        if "error" in r:
            say(f"   {label:40s} failed: {r['error']}")
        else:
            say(f"   {label:40s} {r['growth_bytes'] / 2**20:8.1f} MiB = {r['ratio']:.2f} x input")
    return {"ratio": main["ratio"], "runs": runs}


# ------------------------------------------------------------------------------ scaling
def bench_scaling(clock: Clock, quick: bool) -> None:
    """Print how our search and the literal loop scale with tokens and with candidates."""
    BAPO, _ = loss_classes()
    token_counts = [1024, 4096] if quick else [4096, 16384, 65536, 262144, 1048576]
    say(f"## Scaling with tokens (paper grid, 53 candidates, never met; {clock.name})")
    say(f"   {'tokens':>9s} {'ours':>12s} {'literal':>12s} {'lit/ours':>9s}")
    search = BAPO(**PAPER).search
    for n in token_counts:
        shape = (max(1, n // 1024), min(n, 1024))
        b = make_batch(shape, seed=3)
        ratio, finite = ratio_of(b)
        adv, mask = b["advantages"], b["action_mask"]
        bmask = mask.bool()
        reps = 3 if n >= 262144 else 7
        t = clock.measure(
            {
                "ours": lambda: search.decide(search.local_sums(ratio, adv, bmask, finite)),
                "literal": lambda: literal_search(ratio, adv, mask, PAPER),
            },
            reps,
            warmup=1,
        )
        say(
            f"   {n:9,d} {fmt_ms(t['ours'][0])}  {fmt_ms(t['literal'][0])} "
            f"{t['literal'][0] / t['ours'][0]:8.1f}x"
        )
    n = 4096 if quick else 65536
    say(f"## Scaling with candidates ({n:,} tokens, never met: the walk visits every candidate)")
    say(f"   {'cands':>6s} {'steps':>6s} {'ours':>12s} {'literal':>12s} {'lit/ours':>9s}")
    b = make_batch((n // 1024, 1024), seed=3)
    ratio, finite = ratio_of(b)
    adv, mask = b["advantages"], b["action_mask"]
    bmask = mask.bool()
    for total in CANDIDATE_GRIDS:
        kwargs = grid_kwargs(total)
        search = BAPO(**kwargs).search
        steps = search.decide(search.local_sums(ratio, adv, bmask, finite)).steps
        t = clock.measure(
            {
                "ours": lambda: search.decide(search.local_sums(ratio, adv, bmask, finite)),
                "literal": lambda: literal_search(ratio, adv, mask, kwargs),
            },
            3 if total >= 500 else 5,
            warmup=1,
        )
        count = len(search.upper) + len(search.lower)
        say(
            f"   {count:6d} {steps:6d} {fmt_ms(t['ours'][0])}  {fmt_ms(t['literal'][0])} "
            f"{t['literal'][0] / t['ours'][0]:8.1f}x"
        )


# ------------------------------------------------------------------------------ report
def verdict(key: str, value) -> str:
    """Return PASS or MISS for one figure against its target and hard limit."""
    _, target, limit, higher = TARGETS[key]
    if value is None:
        return "MISS (no figure)"
    if higher is None:
        return "PASS" if value == target else "MISS"
    meets = value >= target if higher else value <= target
    if meets:
        return "PASS"
    if limit is not None and (value < limit if higher else value > limit):
        return "MISS (past the hard limit)"
    return "MISS (within the hard limit)"


def summary(figures: Dict, steady_heap: Optional[float]) -> List[str]:
    """Return the summary table's lines."""
    lines = ["## Summary", f"   {'figure':40s} {'value':>10s}   {'target':>19s}   verdict"]
    for key, (label, target, limit, higher) in TARGETS.items():
        value = figures.get(key)
        if higher is None:
            goal = f"== {target}"
        else:
            goal = (">= " if higher else "<= ") + f"{target}"
            if limit is not None:
                goal += f" ({'not <' if higher else 'not >'} {limit})"
        shown = (
            "n/a" if value is None else (f"{value}" if isinstance(value, int) else f"{value:.2f}")
        )
        lines.append(f"   {label:40s} {shown:>10s}   {goal:>19s}   {verdict(key, value)}")
    shown = "n/a" if steady_heap is None else f"{steady_heap:.2f}"
    lines.append(
        f"   {'BAPO / PPO loss forward, steady heap':40s} {shown:>10s}   "
        f"{'':>19s}   information only"
    )
    lines.append(f"   ({STEADY_HEAP_NOTE})")
    return lines


def parse_args(argv=None):
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--scaling", action="store_true", help="also print scaling tables")
    parser.add_argument("--profile", action="store_true", help="full torch.profiler tables")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=None, help="override repeat count")
    parser.add_argument("--skip-dp", action="store_true", help="skip the torchrun part")
    parser.add_argument("--skip-rss", action="store_true", help="skip the memory subprocesses")
    parser.add_argument(
        "--loss-only",
        action="store_true",
        help="only the loss timing, then its JSON (steady-heap child)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Run every part of the benchmark and print its JSON line last."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.repeats:
        size["repeats"] = args.repeats
    clock = Clock("cpu", args.threads)
    if args.loss_only:
        loss = bench_loss(clock, size["loss_shape"], size["repeats"], "cpu")
        print(json.dumps(dict(loss, malloc=machine.malloc_settings())), flush=True)
        return 0
    say(
        "# BAPO bound-search benchmark"
        + (" (--quick: tiny sizes, figures meaningless)" if args.quick else "")
    )
    for line in machine.describe(args.threads, clock.name):
        say("   " + line)
    say()

    loss = bench_loss(clock, size["loss_shape"], size["repeats"], "cpu")
    say()
    steady = bench_loss_steady_heap(args, size["loss_timeout"])
    if "error" in steady:
        say(f"## Steady heap: FAILED: {steady['error']}")
    say()
    stages = bench_stages(clock, size["loss_shape"], size["repeats"], "cpu")
    say()
    if args.profile:
        profile_tables(size["loss_shape"], 25)
        say()
    search = bench_search(clock, size["loss_shape"], size["repeats"], "cpu", size["mid_shape"])
    say()
    if args.skip_dp:
        dp: Dict[str, Any] = {"error": "skipped (--skip-dp)"}
        say("## Data parallel: skipped (--skip-dp)")
    else:
        dp = bench_dp(size["dp_tokens"], size["dp_repeats"], size["dp_timeout"])
        if "error" in dp:
            say(f"## Data parallel: FAILED: {dp['error']}")
    say()
    if args.skip_rss:
        rss: Dict[str, Any] = {"error": "skipped (--skip-rss)"}
        say("## Peak RSS: skipped (--skip-rss)")
    else:
        rss = bench_rss(size["rss_tokens"], size["rss_timeout"], info=not args.quick)
    say()

    cuda = None
    if torch.cuda.is_available():
        cuda = bench_cuda.run("cuda", "quick" if args.quick else "full")
        for line in bench_cuda.report(cuda):
            say(line)
    else:
        say("## CUDA: skipped, no CUDA device (torch.cuda.is_available() is False)")
    say()
    if args.scaling:
        bench_scaling(clock, args.quick)
        say()

    figures = {
        "bapo_over_ppo_loss": loss["ratio"],
        "speedup_vs_literal_loop": search["speedup"],
        "dp_speedup_vs_per_candidate_allreduce": dp.get("speedup"),
        "collectives_per_call": dp.get("collectives", {}).get("loss_synced"),
        "all_reduce_values_per_call": dp.get("collectives", {}).get("loss_synced_values"),
        "large_grid_peak_rss_over_input": rss.get("ratio"),
    }
    for line in summary(figures, steady.get("ratio")):
        say(line)
    same_pair = bool(search["same_pair"] and dp.get("same_pair", False))
    say(f"   same pair (literal loop == our search, single process and DP): {same_pair}")
    say(f"   bapo_search_steps on the timed batch: {loss['steps']} (expected {PAPER_PATH_STEPS})")
    result = dict(
        figures,
        bapo_over_ppo_loss_steady_heap=steady.get("ratio"),
        same_pair=same_pair,
        bapo_search_steps=loss["steps"],
        bapo_over_ppo_fwd_bwd=loss["fwd_bwd_ratio"],
        all_targets_met=all(verdict(k, v) == "PASS" for k, v in figures.items()),
        clock=clock.name,
        threads=args.threads,
        quick=args.quick,
        checks={
            "single_process": search["pairs"],
            "mid_path": search["mid_path"],
            "dp_same_pair": dp.get("same_pair"),
            "dp_collectives": dp.get("collectives"),
            "steady_heap_malloc": steady.get("malloc"),
        },
        ms={
            "loss": loss["ms"],
            "loss_steady_heap": steady.get("ms"),
            "stages": stages,
            "search": search["ms"],
            "dp": {k: v * 1e3 for k, v in dp.get("median_s", {}).items()},
        },
        errors={
            k: v["error"]
            for k, v in (("steady_heap", steady), ("dp", dp), ("rss", rss))
            if "error" in v
        },
        cuda=cuda,
    )
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
