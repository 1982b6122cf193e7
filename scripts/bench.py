"""`make bench`: BAPO's cost beside PPO, against a per-candidate search, over ranks, in memory.

Each figure is a ratio against a baseline timed beside it (``torch.utils.benchmark``, interleaved
rounds, medians), printed with its target; the last stdout line is one JSON object. The figures
and their baselines are described in docs/benchmarks.md. Run: python -m scripts.bench [--quick]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
import torch.utils.benchmark as benchmark

from scripts.harness import cases
from scripts.harness.cases import PAPER, bench_batch, search_inputs
from scripts.harness.launch import torchrun

# key: (label, target, hard limit, higher is better; None: must equal the target)
TARGETS = {
    "bapo_over_ppo_loss": ("BAPO / PPO loss forward", 2.0, 3.0, False),
    "bapo_over_ppo_fwd_bwd": ("BAPO / PPO forward + backward", 1.5, 2.0, False),
    "speedup_vs_literal_loop": ("literal loop / our search", 3.0, 2.0, True),
    "dp_speedup_vs_per_candidate_allreduce": ("DP per-candidate / ours", 10.0, 5.0, True),
    "collectives_per_call": ("collectives per synced call", 1, 1, None),
    # the paper grid's 16 + 37 candidates, the non-finite count, the sync's 7-value header
    "all_reduce_values_per_call": ("values per synced all-reduce", 61, 61, None),
    "large_grid_peak_rss_over_input": ("peak RSS growth / input", 8.0, None, False),
}
SIZES: Dict[str, Dict[str, Any]] = {
    "full": dict(shape=(64, 1024), rounds=15, dp_tokens=16384, dp_repeats=15, rss_tokens=2_000_000),
    "quick": dict(shape=(4, 256), rounds=3, dp_tokens=1024, dp_repeats=3, rss_tokens=50_000),
}
# 500 lower and 1,500 upper candidates
LARGE_GRID: Dict[str, Any] = dict(zip(cases.RANGE_ARGS, (0.5, 0.999, 0.001, 1.0, 2.499, 0.001)))
QWEN2_0_5B: Dict[str, Any] = dict(  # Qwen2-0.5B's config.json, so that no weights are downloaded
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def timed(fns: Dict[str, Callable], rounds: int) -> Dict[str, float]:
    """Median seconds per call of each function, in interleaved rounds."""
    samples: Dict[str, list] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: lazy allocations and caches
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(benchmark.Timer("fn()", globals={"fn": fn}).timeit(3).median)
    return {name: statistics.median(values) for name, values in samples.items()}


def losses():
    """The two loss functions compared: BAPO's paper defaults, PPO's clip_range 0.2."""
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
    from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn

    return BAPOPolicyLossFn(**PAPER), PPOPolicyLossFn(clip_range=0.2)


def loss_times(batch, rounds: int, backward: bool = False) -> Dict[str, float]:
    """Seconds per BAPO and per PPO call on ``batch`` (forward, or forward and backward)."""
    calls = {name: lambda fn=fn: fn(**batch)[0] for name, fn in zip(("bapo", "ppo"), losses())}
    if backward:
        calls = {name: lambda call=call: call().backward() for name, call in calls.items()}
    return timed(calls, rounds)


def bench_loss(shape, rounds: int) -> Dict:
    """The forward (and forward + backward) of BAPO over PPO's, on one micro-batch."""
    batch = bench_batch(shape, seed=0)
    batch["logprob"].requires_grad_(True)
    forward, both = loss_times(batch, rounds), loss_times(batch, rounds, backward=True)
    steps = losses()[0](**batch)[1]["bapo_search_steps"]
    print(f"## Loss, {batch['logprob'].numel():,} tokens: ms {forward}; {steps} search steps")
    return {
        "ratio": forward["bapo"] / forward["ppo"],
        "fwd_bwd_ratio": both["bapo"] / both["ppo"],
        "steps": steps,
        "ms": {name: seconds * 1e3 for name, seconds in forward.items()},
    }


def bench_search(shape, rounds: int) -> Dict:
    """Our search against the per-candidate loop, and both on a target met mid-path."""
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    ratio, adv, mask, finite = search_inputs(bench_batch(shape, seed=0))

    def walk(search):
        result = search.decide(search.local_sums(ratio, adv, mask, finite))
        return result.clip_low, result.clip_high, result.steps

    paper = losses()[0].search
    contenders = {
        "literal": lambda: cases.literal_search(ratio, adv, mask, PAPER),
        "ours": lambda: walk(paper),
    }
    times = timed(contenders, rounds)
    pairs = {name: call() for name, call in contenders.items()}
    # A target halfway between rho at upper steps 9 and 10: both must stop at step 10.
    sums = [cases.surrogate_sums(ratio, adv, mask, 0.6, 1.2 + 0.05 * k).tolist() for k in (9, 10)]
    rho = [p / (p + n) for p, n in sums]
    grid = dict(PAPER, positive_contribution_target=(rho[0] + rho[1]) / 2)
    mid = walk(BAPOPolicyLossFn(**grid).search)
    mid_ok = cases.literal_search(ratio, adv, mask, grid) == mid and mid[2] == 10
    print(f"## Search: seconds {times}; pairs {pairs}; mid-path stop at step 10: {mid_ok}")
    return {
        "speedup": times["literal"] / times["ours"],
        "same_pair": pairs["literal"] == pairs["ours"] and mid_ok,
        "ms": {name: seconds * 1e3 for name, seconds in times.items()},
    }


def bench_dp(tokens: int, repeats: int) -> Dict:
    """4 gloo ranks in the harness's DP worker, which writes its JSON to a temporary file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dp.json"
        argv = ["bench", "--out", out, "--tokens-per-rank", tokens, "--repeats", repeats]
        launch = torchrun(4, "scripts.harness.dp_worker", argv, timeout_s=600)
        if launch.code != 0 or not out.exists():
            return {"error": f"torchrun exit {launch.code}: {launch.err[-2000:]}"}
        result = json.loads(out.read_text())
    med = result["median_s"]
    print(f"## Data parallel, 4 ranks x {tokens:,} tokens: seconds {med}, {result['collectives']}")
    return result


def bench_rss(tokens: int) -> Dict:
    """Peak RSS growth of one large-grid search over its inputs' bytes (run before the rest).

    Linux's ``clear_refs`` restarts the high-water mark at the current RSS, so that the peak
    counts the search alone.
    """
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    def status_kb(field: str) -> int:
        lines = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in lines if line.startswith(field + ":")).split()[1])

    search = BAPOPolicyLossFn(**LARGE_GRID, positive_contribution_target=0.4).search
    search.decide(search.local_sums(*search_inputs(bench_batch((2, 64), seed=1))))  # warm-up
    batch = bench_batch((tokens // 1000, 1000), seed=0)
    inputs = search_inputs(batch)
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kb("VmRSS")
    search.decide(search.local_sums(*inputs))
    growth = (status_kb("VmHWM") - before) * 1024
    size = sum(t.numel() * t.element_size() for t in batch.values())
    print(f"## Peak RSS growth of one search, {tokens:,} tokens: {growth / size:.2f} x input")
    return {"growth_bytes": growth, "input_bytes": size, "ratio": growth / size}


def bench_cuda(quick: bool, device: str = "cuda") -> Dict:
    """The CUDA figures; ``device="cpu"`` runs the same code, so that a test can exercise it."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    rounds, search = 3 if quick else 15, losses()[0].search
    name = torch.cuda.get_device_name(0) if device == "cuda" else device
    result: Dict = {"device": name, "bapo_over_ppo_fwd": {}, "search_ms": {}}
    for tokens in [4096] if quick else [65_536, 8_388_608]:
        batch = bench_batch((tokens // 1024, 1024), seed=0, device=device)
        t = loss_times(batch, rounds)
        result["bapo_over_ppo_fwd"][tokens] = t["bapo"] / t["ppo"]
        inputs = search_inputs(batch)
        walk = timed({"walk": lambda: search.decide(search.local_sums(*inputs))}, rounds)
        result["search_ms"][tokens] = walk["walk"] * 1e3
    tokens = 4096 if quick else 65_536
    batch = bench_batch((tokens // 1024, 1024), seed=0, device=device)
    batch["logprob"].requires_grad_(True)
    both = loss_times(batch, rounds, backward=True)
    result["bapo_over_ppo_fwd_bwd"] = {tokens: both["bapo"] / both["ppo"]}
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256)
    config = dict(QWEN2_0_5B, **small, num_attention_heads=2) if quick else QWEN2_0_5B
    model = AutoModelForCausalLM.from_config(Qwen2Config(**config), torch_dtype=torch.bfloat16)
    model = model.to(device)
    ids = torch.randint(0, config["vocab_size"], (2, 64) if quick else (8, 2048), device=device)
    step = timed({"step": lambda: model(input_ids=ids, labels=ids).loss.backward()}, 3)
    result["step_overhead_share"] = (both["bapo"] - both["ppo"]) / step["step"]
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
    rss = bench_rss(size["rss_tokens"])  # first: later parts leave freed memory behind
    loss = bench_loss(size["shape"], size["rounds"])
    search = bench_search(size["shape"], size["rounds"])
    dp = bench_dp(size["dp_tokens"], size["dp_repeats"])
    cuda: Optional[Dict] = bench_cuda(args.quick) if torch.cuda.is_available() else None
    if cuda is None:
        print("## CUDA: skipped, no CUDA device")
    collectives = dp.get("collectives", {})
    figures = {
        "bapo_over_ppo_loss": loss["ratio"],
        "bapo_over_ppo_fwd_bwd": loss["fwd_bwd_ratio"],
        "speedup_vs_literal_loop": search["speedup"],
        "dp_speedup_vs_per_candidate_allreduce": dp.get("speedup"),
        "collectives_per_call": collectives.get("loss_synced"),
        "all_reduce_values_per_call": collectives.get("loss_synced_values"),
        "large_grid_peak_rss_over_input": rss.get("ratio"),
    }
    print("## Summary")
    for key, value in figures.items():
        label, target, _, _ = TARGETS[key]
        shown = "n/a" if value is None else f"{value:.2f}"
        print(f"   {label:32s} {shown:>8s}   target {target}   {verdict(key, value)}")
    result = dict(
        figures,
        same_pair=bool(search["same_pair"] and dp.get("same_pair", False)),
        bapo_search_steps=loss["steps"],
        all_targets_met=all(verdict(k, v) == "PASS" for k, v in figures.items()),
        quick=args.quick,
        checks={"dp_collectives": collectives},
        ms={
            "loss": loss["ms"],
            "search": search["ms"],
            "dp": {k: v * 1e3 for k, v in dp.get("median_s", {}).items()},
        },
        errors={"dp": dp["error"]} if "error" in dp else {},
        cuda=cuda,
    )
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
