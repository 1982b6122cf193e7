"""`make bench`: BAPO's cost beside PPO, and against the authors' search over ranks.

Each figure is a ratio against a baseline timed beside it (``torch.utils.benchmark``, interleaved
rounds, medians), printed with its target; the last stdout line is one JSON object. The figures
and their baselines are described in docs/benchmarks.md. Run: python -m scripts.bench [--quick]
"""

import argparse
import json
import os
import statistics
import sys
from typing import Any, Callable, Dict, Optional

import torch
import torch.utils.benchmark as benchmark

from scripts.harness.cases import CHOICE, PAPER, bench_batch, product_search
from scripts.harness.launch import torchrun
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn

# key: (label, target, hard limit, higher is better; None: must equal the target)
TARGETS = {
    "bapo_over_ppo_loss": ("BAPO / PPO loss forward", 2.0, 3.0, False),
    "bapo_over_ppo_fwd_bwd": ("BAPO / PPO forward + backward", 1.5, 2.0, False),
    "dp_speedup_vs_per_candidate_allreduce": ("DP per-candidate / ours", 10.0, 5.0, True),
    "collectives_per_call": ("collectives per synced call", 1, 1, None),
    # two sums in each of the 55 bins that the paper grid's 16 + 37 bounds and 0 cut, the
    # failure flag and the non-finite count
    "all_reduce_values_per_call": ("values per synced all-reduce", 112, 112, None),
}
SIZES: Dict[str, Dict[str, Any]] = {
    "full": dict(shape=(64, 1024), rounds=15, dp_tokens=16384, dp_repeats=15),
    "quick": dict(shape=(4, 256), rounds=3, dp_tokens=1024, dp_repeats=3),
}


def timed(fns: Dict[str, Callable], rounds: int) -> Dict[str, float]:
    """Median seconds per call of each function, in interleaved rounds."""
    samples: Dict[str, list] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: lazy allocations and caches
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(benchmark.Timer("fn()", globals={"fn": fn}).timeit(3).median)
    return {name: statistics.median(values) for name, values in samples.items()}


def loss_times(batch, rounds: int, backward: bool = False) -> Dict[str, float]:
    """Seconds per call of BAPO (paper defaults) and of PPO (clip range 0.2) on ``batch``."""
    losses = zip(("bapo", "ppo"), (BAPOPolicyLossFn(**PAPER), PPOPolicyLossFn(clip_range=0.2)))
    calls = {name: lambda fn=fn: fn(**batch)[0] for name, fn in losses}
    if backward:
        calls = {name: lambda call=call: call().backward() for name, call in calls.items()}
    return timed(calls, rounds)


def bench_loss(shape, rounds: int) -> Dict:
    """The forward (and forward + backward) of BAPO over PPO's, on one micro-batch."""
    batch = bench_batch(shape, seed=0)
    batch["logprob"].requires_grad_(True)
    forward, both = loss_times(batch, rounds), loss_times(batch, rounds, backward=True)
    metrics = BAPOPolicyLossFn(**PAPER)(**batch)[1]
    pair = [metrics[key] for key in CHOICE]
    ms = {name: seconds * 1e3 for name, seconds in forward.items()}
    tokens = batch["logprob"].numel()
    print(f"## Loss, {tokens:,} tokens: ms {ms}; (c_low, c_high, steps, rho) {pair}")
    ratios = {
        "ratio": forward["bapo"] / forward["ppo"],
        "fwd_bwd_ratio": both["bapo"] / both["ppo"],
    }
    return {**ratios, "pair": pair, "ms": ms}


def bench_dp(tokens: int, repeats: int) -> Dict:
    """4 gloo ranks in the harness's DP worker, which prints its figures as one JSON line."""
    argv = ["bench", "--tokens-per-rank", tokens, "--repeats", repeats]
    launch = torchrun(4, "scripts.harness.dp_worker", argv, timeout_s=600)
    if launch.code != 0:
        return {"error": f"torchrun exit {launch.code}: {launch.err[-2000:]}"}
    result = json.loads(launch.out.strip().splitlines()[-1])
    med = result["median_s"]
    print(f"## Data parallel, 4 ranks x {tokens:,} tokens: seconds {med}, {result['collectives']}")
    return result


def bench_cuda(quick: bool, device: str = "cuda") -> Dict:
    """The CUDA figures; ``device="cpu"`` runs the same code, so that a test can exercise it."""
    rounds, bapo = 3 if quick else 15, BAPOPolicyLossFn(**PAPER)
    name = torch.cuda.get_device_name(0) if device == "cuda" else device
    result: Dict = {"device": name, "bapo_over_ppo_fwd": {}, "search_ms": {}, "pairs": {}}
    for tokens in [4096] if quick else [65_536, 8_388_608]:
        batch = bench_batch((tokens // 1024, 1024), seed=0, device=device)
        t = loss_times(batch, rounds)
        result["bapo_over_ppo_fwd"][tokens] = t["bapo"] / t["ppo"]
        search = timed({"search": lambda: product_search(bapo, batch)}, rounds)
        result["search_ms"][tokens] = search["search"] * 1e3
        result["pairs"][tokens] = list(product_search(bapo, batch))
    tokens = 4096 if quick else 65_536
    batch = bench_batch((tokens // 1024, 1024), seed=0, device=device)
    batch["logprob"].requires_grad_(True)
    both = loss_times(batch, rounds, backward=True)
    result["bapo_over_ppo_fwd_bwd"] = {tokens: both["bapo"] / both["ppo"]}
    print(f"## CUDA ({name}): {json.dumps(result)}")
    return result


def verdict(key: str, value) -> str:
    """PASS or MISS for one figure against its target and hard limit."""
    _, target, limit, higher = TARGETS[key]
    if value is None or higher is None:
        return "PASS" if value == target else "MISS"
    if value >= target if higher else value <= target:
        return "PASS"
    past = limit is not None and (value < limit if higher else value > limit)
    return "MISS (past the hard limit)" if past else "MISS (within the hard limit)"


def main(argv=None) -> int:
    """Run every part and print the summary, then the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    size = SIZES["quick" if args.quick else "full"]
    print(f"# BAPO benchmark: torch {torch.__version__}, {os.cpu_count()} cores, {size}")
    loss = bench_loss(size["shape"], size["rounds"])
    dp = bench_dp(size["dp_tokens"], size["dp_repeats"])
    cuda: Optional[Dict] = bench_cuda(args.quick) if torch.cuda.is_available() else None
    if cuda is None:
        print("## CUDA: skipped, no CUDA device")
    ops = dp.get("collectives", {})
    measured = [loss["ratio"], loss["fwd_bwd_ratio"], dp.get("speedup"), ops.get("loss_synced")]
    figures = dict(zip(TARGETS, measured + [ops.get("loss_synced_values")]))  # in TARGETS' order
    print("## Summary")
    for key, value in figures.items():
        label, target, _, _ = TARGETS[key]
        shown = "n/a" if value is None else f"{value:.2f}"
        print(f"   {label:32s} {shown:>8s}   target {target}   {verdict(key, value)}")
    pairs = dp.get("pairs", {"ours": [None], "authors": []})
    result = dict(figures, all_targets_met=all(verdict(k, v) == "PASS" for k, v in figures.items()))
    # the authors' loop and our search in their order stop at the same pair, on every rank
    result["same_pair"] = pairs["ours"][:3] == pairs["authors"] and dp.get("ranks_agree", False)
    result.update(pair=loss["pair"], quick=args.quick, dp=dp, ms=loss["ms"], cuda=cuda)
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
