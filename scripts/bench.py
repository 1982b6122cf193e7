"""`make bench`: BAPO's cost beside PPO, and against the authors' search over ranks.

Each figure is a ratio against a baseline timed beside it (``torch.utils.benchmark``, interleaved
rounds, medians), printed with its target; the last stdout line is one JSON object. On a CUDA
device it also times a Qwen2-0.5B-shaped model's training step through each loss. The figures
and their baselines are described in docs/benchmarks.md. It writes no files; a signal ends its
torchrun launches, then it (``scripts/harness/owned_run.py``). Run: python -m scripts.bench
[--quick]
"""

import argparse
import json
import os
import statistics
import sys
from typing import Any, Callable, Dict, Tuple

import torch
import torch.utils.benchmark as benchmark

from scripts.harness.cases import CHOICE, PAPER, bench_batch, product_search
from scripts.harness.launch import torchrun
from scripts.harness.model import build_qwen2
from scripts.harness.owned_run import owned_run
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn

# key: (label, target, hard limit, higher is better; None: must equal the target)
TARGETS = {
    "bapo_over_ppo_loss": ("BAPO / PPO loss forward", 2.0, 3.0, False),
    "bapo_over_ppo_fwd_bwd": ("BAPO / PPO forward + backward", 1.5, 2.0, False),
    "dp_speedup_vs_per_candidate_allreduce": ("DP per-candidate / ours", 10.0, 5.0, True),
    "collectives_per_call": ("collectives per synced call", 1, 1, None),
    # P at the paper grid's 37 upper bounds and N at its 16 lower ones
    "all_reduce_values_per_call": ("values per synced all-reduce", 53, 53, None),
}
# cuda_tokens: the CUDA loss-only sizes; step: (rows, prompt, response) tokens of the model's step
SIZES: Dict[str, Dict[str, Any]] = {
    "full": dict(shape=(64, 1024), rounds=15, dp_tokens=16384, dp_repeats=15),
    "quick": dict(shape=(4, 256), rounds=3, dp_tokens=1024, dp_repeats=3),
}
SIZES["full"].update(cuda_tokens=[65_536, 8_388_608], step=(8, 128, 2048))
SIZES["quick"].update(cuda_tokens=[4096], step=(2, 32, 256))
# search_scope: update's pass against a training update in verl's engine (CPU, one gloo rank)
SIZES["full"].update(update_hidden=512, update_rounds=7)
SIZES["quick"].update(update_hidden=32, update_rounds=1)
# Qwen2-0.5B's shape, as its config.json gives it; settings that cost nothing stay at the defaults
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, vocab_size=151936)
QWEN2_05B.update(num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)


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


def bench_update_pass(size: Dict) -> Dict:
    """What ``search_scope: update``'s pass adds to an optimizer update, as a share of one.

    The trainer's ``bench_update`` on one gloo rank: 64 sequences, 8 per call, a 2-layer Llama
    of width ``update_hidden``, BAPO per call against BAPO per update in interleaved rounds.
    """
    argv = ["--out", "unused", "--bench-update", size["update_rounds"], "--micro", 8]
    launch = torchrun(1, "scripts.harness.trainer", [*argv, "--hidden", size["update_hidden"]], 900)
    if launch.code != 0:
        return {"error": f"torchrun exit {launch.code}: {launch.err[-2000:]}"}
    result = json.loads(launch.out.strip().splitlines()[-1])
    share, alone = result["pass_share_of_step"], result["pass_alone_share_of_step"]
    head = f"## Update pass (CPU, width {result['hidden']}): adds {share:.2f} of a step"
    print(f"{head} (alone {alone:.2f}), s {result['median_s']}")
    return result


def cuda_loss(size: Dict, device: str) -> Dict:
    """The loss alone on ``device``: BAPO's forward over PPO's, and the search's own time."""
    rounds, bapo = size["rounds"], BAPOPolicyLossFn(**PAPER)
    result: Dict = {"bapo_over_ppo_fwd": {}, "search_ms": {}, "pairs": {}}
    for tokens in size["cuda_tokens"]:
        batch = bench_batch((tokens // 1024, 1024), seed=0, device=device)
        t = loss_times(batch, rounds)
        result["bapo_over_ppo_fwd"][tokens] = t["bapo"] / t["ppo"]
        search = timed({"search": lambda: product_search(bapo, batch)}, rounds)
        result["search_ms"][tokens] = search["search"] * 1e3
        result["pairs"][tokens] = list(product_search(bapo, batch))
    tokens = size["cuda_tokens"][0]
    batch = bench_batch((tokens // 1024, 1024), seed=0, device=device)
    batch["logprob"].requires_grad_(True)
    both = loss_times(batch, rounds, backward=True)
    result["bapo_over_ppo_fwd_bwd"] = {tokens: both["bapo"] / both["ppo"]}
    print(f"## CUDA loss: {json.dumps(result)}")
    return result


def response_logprobs(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Float32 log-probs of the response tokens ``ids[:, prompt:]``, as verl's actor takes them.

    The LM head runs only where a position predicts a response token: over a 151,936-token
    vocabulary its float32 log-softmax is most of the step's memory.
    """
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, prompt - 1 : -1]
    logits = model.lm_head(hidden)
    return logits.log_softmax(-1, dtype=torch.float32).gather(-1, ids[:, prompt:, None])[..., 0]


def step_inputs(model, step: Tuple[int, int, int], negative_share: float = 0.85):
    """Token ids, and the loss's inputs but the log-probs, of ``step`` (rows, prompt, response).

    Mask and advantages are ``bench_batch``'s; the old log-probs sit its log-ratios (std 0.3)
    away from the model's own, so the ratios span every bound, as in the loss-only figures.
    """
    rows, prompt, response = step
    seeded = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (rows, prompt + response), generator=seeded)
    data = bench_batch((rows, response), 0, negative_share, device=model.device)
    ids = ids.to(model.device)
    with torch.no_grad():
        old = response_logprobs(model, ids, prompt) - (data["logprob"] - data["old_logprob"])
    kept = {key: data[key] for key in ("action_mask", "advantages")}
    return ids, dict(kept, old_logprob=old)


def bench_step(model, step: Tuple[int, int, int], rounds: int, negative_share: float = 0.85):
    """Ms per forward and backward of ``model`` through BAPO and through PPO; BAPO's choice.

    BAPO at the paper's settings, PPO at clip 0.2 / 0.28 (clip-higher). Gradients accumulate from
    step to step, as they do over a mini-batch's micro-batches.
    """
    ids, batch = step_inputs(model, step, negative_share)
    ppo = PPOPolicyLossFn(clip_range_low=0.2, clip_range_high=0.28)
    losses = {"bapo": BAPOPolicyLossFn(**PAPER), "ppo": ppo}

    def train_step(loss_fn) -> Dict:
        loss, metrics = loss_fn(logprob=response_logprobs(model, ids, step[1]), **batch)
        loss.backward()
        return metrics

    seconds = timed({name: lambda fn=fn: train_step(fn) for name, fn in losses.items()}, rounds)
    ms = {name: value * 1e3 for name, value in seconds.items()}
    pair = [train_step(losses["bapo"])[key] for key in CHOICE]
    overhead = (ms["bapo"] - ms["ppo"]) / ms["ppo"] * 100
    return {"rows_prompt_response": list(step), "ms": ms, "overhead_pct": overhead, "pair": pair}


def bench_cuda(size: Dict) -> Dict:
    """The CUDA figures: the loss alone, then a Qwen2-0.5B-shaped bf16 model's step through it."""
    result = {"device": torch.cuda.get_device_name(0), **cuda_loss(size, "cuda")}
    model = build_qwen2(QWEN2_05B, torch.bfloat16, "cuda")
    result["step"] = step = bench_step(model, size["step"], size["rounds"])
    rows, prompt, response = size["step"]
    print(
        f"## CUDA step ({result['device']}), Qwen2-0.5B shape, bf16, {rows} x ({prompt} prompt +"
        f" {response} response) tokens: ms {step['ms']}, BAPO overhead"
        f" {step['overhead_pct']:.2f}%; (c_low, c_high, steps, rho) {step['pair']}"
    )
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
    with owned_run():
        run_parts(args)
    return 0


def run_parts(args) -> None:
    """Every part, its summary and the JSON line."""
    torch.set_num_threads(1)
    size = SIZES["quick" if args.quick else "full"]
    print(f"# BAPO benchmark: torch {torch.__version__}, {os.cpu_count()} cores, {size}")
    loss = bench_loss(size["shape"], size["rounds"])
    dp = bench_dp(size["dp_tokens"], size["dp_repeats"])
    update = bench_update_pass(size)
    cuda = bench_cuda(size) if torch.cuda.is_available() else {"skipped": "no CUDA device"}
    if "skipped" in cuda:
        print(f"## CUDA loss and step: skipped, {cuda['skipped']}")
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
    result.update(update_pass_share_of_step=update.get("pass_share_of_step"), update_pass=update)
    print(json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    sys.exit(main())
