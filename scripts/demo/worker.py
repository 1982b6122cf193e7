"""torchrun entry point: train the tiny LM with PPO and/or BAPO on stale GRPO rollouts.

The policy lives in verl 0.8's FSDP training engine, ``FSDPEngineWithLMHead`` (FSDP2, gloo, CPU),
the engine Trinity's actor worker trains with. Every rank samples its own prompts from a copy
of the policy whose weights are gathered from the engine and lag ``--staleness`` updates behind
(Trinity's async mode), scores them, computes GRPO advantages, and hands the batch to
``engine.train_batch`` once per epoch. The engine splits it into micro-batches, runs the model,
calls Trinity's ``TrinityPolicyLoss`` with its own data-parallel group, and steps the
optimiser. Rank 0 writes one JSON line of metrics per step to ``<out>/<algo>/metrics.jsonl``.

Run through ``scripts/bapo_demo.py``, which launches it and draws the report.
"""

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Dict, List

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `demo` importable

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PPO_CLIP_LOW, PPO_CLIP_HIGH = 0.2, 0.28  # PPOPolicyLossFn ranges: ratio clipped to [0.8, 1.28]


def parse_args(argv=None) -> argparse.Namespace:
    """The worker's flags (the launcher passes its own values)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algos", default="ppo,bapo", help="comma-separated: ppo, bapo")
    p.add_argument("--steps", type=int, required=True)  # the launcher passes its own
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts-per-rank", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--no-sync",
        action="store_true",
        help="BAPO with sync_across_dp=false (each rank picks its own pair; for comparison)",
    )
    return p.parse_args(argv)


def algorithm_config(algo: str, no_sync: bool):
    """Trinity's AlgorithmConfig for the two runs: fixed PPO clipping or BAPO's defaults."""
    from demo.loss import loss_config
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    if algo == "ppo":
        name, args = "ppo", {"clip_range_low": PPO_CLIP_LOW, "clip_range_high": PPO_CLIP_HIGH}
    elif algo == "bapo":
        name, args = "bapo", BAPOPolicyLossFn.default_args()
        if no_sync:
            args["sync_across_dp"] = False
    else:
        raise ValueError(f"unknown algorithm {algo!r}")
    return loss_config(name, args)


def bapo_start_pair() -> List[float]:
    """Where every BAPO search starts (a-, a+) under the defaults the demo uses."""
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    args = BAPOPolicyLossFn.default_args()
    return [args["ratio_lower_start"], args["ratio_upper_start"]]


def require_patched_trinity() -> None:
    """Fail early, with the fix, if the installed trinity-rft lacks the dp_group series."""
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    if "dp_group" in getattr(BAPOPolicyLossFn(), "select_keys"):  # released: read as data
        raise SystemExit(
            "the installed trinity-rft is not patched (no dp_group runtime key); "
            "run `make setup` or `.venv/bin/python scripts/trinity_patches.py apply`"
        )


class LossTap:
    """The engine's ``loss_function``: TrinityPolicyLoss, plus a note of what each call saw.

    Collects, per call, the pair used, the loss's metrics and Eq. 8's P and N recomputed here
    on the same tokens; on the first epoch also the policy's entropy on the responses, and on a
    step whose rollout policy is the engine's own weights, how far the engine's log-probs are
    from the sampler's. No collective here: the engine's loop must stay as it is.
    """

    def __init__(self, loss, algo: str):
        """Wrap ``loss`` (a TrinityPolicyLoss) for ``algo``."""
        self.loss, self.algo = loss, algo
        self.calls: List[Dict] = []
        self.ent = [0.0, 0.0]
        self.layout_err = 0.0
        self.watch_entropy = self.watch_layout = False

    def __call__(self, model_output, data, dp_group=None):
        """Run the loss as the engine asks, then note what the call saw."""
        from verl.workers.utils.padding import no_padding_2_padding

        loss, metrics = self.loss(model_output=model_output, data=data, dp_group=dp_group)
        mask = data["response_mask"].bool()
        with torch.no_grad():
            log_prob = no_padding_2_padding(model_output["log_probs"], data)
            if self.watch_entropy:
                entropy = no_padding_2_padding(model_output["entropy"], data)
                self.ent[0] += entropy[mask].sum().item()
                self.ent[1] += mask.sum().item()
            if self.watch_layout:
                gap = (log_prob - data["old_log_probs"])[mask].abs()
                self.layout_err = max(self.layout_err, gap.max().item() if gap.numel() else 0.0)
            self.calls.append(call_record(metrics, log_prob, data, mask, self.algo))
        return loss, metrics


def all_sum(values: List[float], group) -> List[float]:
    """Element-wise sum of ``values`` over the group's ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def all_max(value: float, group) -> float:
    """Largest ``value`` over the group's ranks."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def pair_agrees(low: float, high: float, group) -> bool:
    """All-gather the clip pair a rank used and say whether every rank used the same one."""
    mine = torch.tensor([low, high], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def make_rollout(behaviour, prompts_gen, sample_gen, args):
    """This rank's rollout: prompts, sampled responses, rewards, GRPO advantages.

    ``old_log_probs`` are the sampler's own log-probs of the tokens it drew (Trinity's default,
    ``bypass_old_logprobs``). The batch is laid out as Trinity's trainer hands it to the actor
    (see ``demo.batch``); the engine does the rest.
    """
    from demo.batch import rollout_tensordict
    from demo.engine import engine_batch
    from demo.policy import sample_responses
    from demo.task import PROMPT_WIDTH, group_advantages, left_pad, reward, sample_prompts

    rows = sample_prompts(args.prompts_per_rank, prompts_gen)
    rows = [r for r in rows for _ in range(args.group_size)]  # a group per prompt
    prompts, prompt_mask = left_pad(rows, PROMPT_WIDTH)
    responses, response_mask, sampled_lp, _ = sample_responses(
        behaviour, prompts, prompt_mask, sample_gen
    )
    rewards = torch.tensor([reward(p, r) for p, r in zip(rows, responses.tolist())])
    adv = group_advantages(rewards, args.group_size)[:, None] * response_mask
    data = rollout_tensordict(prompts, prompt_mask, responses, response_mask, sampled_lp, adv)
    size = len(data) // args.micro_batches
    return engine_batch(data, micro_batch_size=size, calculate_entropy=True), rewards


def train_step(engine, tap, data, lag: int, args) -> Dict:
    """``--epochs`` calls of ``engine.train_batch`` on one rollout; returns what the tap saw."""
    tap.calls, tap.ent, tap.layout_err = [], [0.0, 0.0], 0.0
    grad_norms = []
    # One train-mode context per update, as Trinity's actor worker enters it; nothing is
    # offloaded, so the engine's offload round trip (a full gc.collect each way) is skipped.
    with engine.train_mode(disable_auto_offload=True):
        for epoch in range(args.epochs):
            tap.watch_entropy = epoch == 0  # the policy's entropy on this step's responses
            tap.watch_layout = epoch == 0 and lag == 0  # rollout policy == engine's weights
            out = engine.train_batch(data, loss_function=tap)
            grad_norms.append(float(out["metrics"]["grad_norm"]))
    return {"calls": tap.calls, "grad_norms": grad_norms, "ent": tuple(tap.ent)}


def call_record(metrics, log_prob, data, mask, algo) -> Dict:
    """The pair one loss call used, its metrics, and Eq. 8's P and N on this rank's tokens."""
    from demo.loss import surrogate_sums

    if algo == "bapo":
        low, high = metrics["actor/bapo_clip_low"], metrics["actor/bapo_clip_high"]
    else:
        low, high = 1.0 - PPO_CLIP_LOW, 1.0 + PPO_CLIP_HIGH
    log_ratio = (log_prob - data["old_log_probs"]).clamp(-20.0, 20.0)
    p, n = surrogate_sums(log_ratio.exp(), data["advantages"], mask, low, high)
    record = {
        "low": low,
        "high": high,
        "p": p,
        "n": n,
        "clipfrac": metrics["actor/pg_clipfrac"],
        "clipfrac_lower": metrics["actor/pg_clipfrac_lower"],
        "ppo_kl": metrics["actor/ppo_kl"],
        "pg_loss": metrics["actor/pg_loss"],
    }
    if algo == "bapo":
        record["rho"] = metrics["actor/bapo_positive_contribution"]
        record["target_met"] = metrics["actor/bapo_target_met"]
        record["search_steps"] = metrics["actor/bapo_search_steps"]
    return record


def check_calls(calls: List[Dict], group, synced: bool) -> None:
    """After a step: all-gather every call's pair, and rho recomputed over the group's tokens.

    Where the loss searched over the group (synced), P and N are summed over the group as the
    loss summed them; otherwise rho is this rank's own.
    """
    for call in calls:
        call["agree"] = pair_agrees(call["low"], call["high"], group)
        p, n = all_sum([call["p"], call["n"]], group) if synced else (call["p"], call["n"])
        call["rho_independent"] = 1.0 if p + n == 0 else p / (p + n)


def mean(xs):
    """Arithmetic mean, None for no values."""
    return sum(xs) / len(xs) if xs else None


def step_metrics(step, algo, lag, rewards, result, layout_err, group, world, started) -> Dict:
    """Combine this rank's numbers with the other ranks' into the step's JSON line."""
    calls = result["calls"]
    local = [
        rewards.sum().item(),
        float(rewards.numel()),
        result["ent"][0],
        result["ent"][1],
        sum(c["clipfrac"] for c in calls),
        sum(c["clipfrac_lower"] for c in calls),
        sum(c["ppo_kl"] for c in calls),
        float(len(calls)),
    ]
    r_sum, r_n, e_sum, e_n, cf, cfl, kl, n_calls = all_sum(local, group)
    lows, highs = [c["low"] for c in calls], [c["high"] for c in calls]
    rho_ind = [c["rho_independent"] for c in calls]
    row = {
        "step": step,
        "algo": algo,
        "behaviour_lag": lag,
        "reward": r_sum / r_n,
        "entropy": e_sum / e_n,
        "grad_norm": mean(result["grad_norms"]),
        "clip_low": mean(lows),
        "clip_high": mean(highs),
        "clip_low_max": max(lows),
        "clip_high_max": max(highs),
        "pairs": [[lo, hi] for lo, hi in zip(lows, highs)],
        "ranks_agree": all(c["agree"] for c in calls),
        "pair_checks": len(calls),
        "pg_clipfrac": cf / n_calls,
        "pg_clipfrac_lower": cfl / n_calls,
        "ppo_kl": kl / n_calls,
        "pg_loss": mean([c["pg_loss"] for c in calls]),
        "rho_independent": mean(rho_ind),
        "logprob_layout_err": layout_err,
        "wall_s": time.time() - started,
        "world_size": world,
    }
    if algo == "bapo":
        rho = [c["rho"] for c in calls]
        row["rho"] = mean(rho)
        row["rho_source"] = "bapo_positive_contribution"
        row["start_pair"] = bapo_start_pair()
        row["rho_check_err"] = max(abs(a - b) for a, b in zip(rho, rho_ind))
        row["target_met"] = mean([c["target_met"] for c in calls])
        row["search_steps"] = mean([c["search_steps"] for c in calls])
    else:
        row["rho"] = mean(rho_ind)
        row["rho_source"] = "surrogate rho at the fixed pair (0.8, 1.28)"
        row["start_pair"] = [1.0 - PPO_CLIP_LOW, 1.0 + PPO_CLIP_HIGH]
    return row


def shared_temp_dir() -> Path:
    """A temporary folder made by rank 0, its path sent to every rank (same machine)."""
    path = [tempfile.mkdtemp(prefix="bapo-demo-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


def run(algo: str, args, rank: int, world: int) -> None:
    """Train one algorithm for ``args.steps`` steps in a fresh engine; rank 0 logs."""
    from demo.engine import build_engine, full_state_dict, save_model
    from demo.loss import GroupSpy
    from demo.policy import build_model
    from trinity.trainer.verl.losses import TrinityPolicyLoss

    started = time.time()
    behaviour = build_model(args.seed).eval()  # the rollout copy; the engine holds the policy
    folder = shared_temp_dir()
    try:
        save_model(behaviour, folder)
        size = args.prompts_per_rank * args.group_size // args.micro_batches
        engine = build_engine(folder, "fsdp2", lr=args.lr, micro_batch_size=size, seed=args.seed)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    group = engine.get_data_parallel_group()
    loss_fn = TrinityPolicyLoss(algorithm_config(algo, args.no_sync))
    spy = GroupSpy(loss_fn.policy_loss_fn, group)
    loss_fn.policy_loss_fn = spy
    tap = LossTap(loss_fn, algo)
    synced = not (algo == "bapo" and args.no_sync)
    snapshots = deque([copy.deepcopy(behaviour.state_dict())], maxlen=args.staleness + 1)
    prompts_gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    sample_gen = torch.Generator().manual_seed(args.seed * 1000 + 500 + rank)

    out = Path(args.out) / algo
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        sink = open(out / "metrics.jsonl", "w")
    for step in range(args.steps):
        lag = len(snapshots) - 1
        behaviour.load_state_dict(snapshots[0])  # the oldest snapshot kept
        data, rewards = make_rollout(behaviour, prompts_gen, sample_gen, args)
        result = train_step(engine, tap, data, lag, args)
        snapshots.append(full_state_dict(engine))
        check_calls(result["calls"], group, synced)
        layout_err = all_max(tap.layout_err, group) if lag == 0 else None
        row = step_metrics(step, algo, lag, rewards, result, layout_err, group, world, started)
        row["dp_group_forwarded"] = spy.forwarded == spy.calls
        row["engine"] = f"{type(engine).__name__} ({engine.engine_config.strategy})"
        if rank == 0:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            if step % args.log_every == 0 or step == args.steps - 1:
                print(progress_line(row), flush=True)
    if rank == 0:
        sink.close()


def progress_line(row: Dict) -> str:
    """One step's metrics as a console line."""
    rho = row["rho"]
    return (
        f"[{row['algo']:4s}] step {row['step']:4d}  reward {row['reward']:.3f}  "
        f"entropy {row['entropy']:.3f}  clip ({row['clip_low']:.2f}, {row['clip_high']:.2f})  "
        f"rho {rho:.3f}  clipfrac {row['pg_clipfrac']:.3f}  grad {row['grad_norm']:.2f}  "
        f"agree {row['ranks_agree']}  {row['wall_s']:.0f}s"
    )


def main(argv=None) -> int:
    """Start gloo, train each algorithm in turn, shut down."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    # A rank that gets no group would choose its own bounds; make that warning fatal here.
    # (With --no-sync the search is told not to reduce, so the warning cannot fire.)
    warnings.filterwarnings("error", message="BAPO: sync_across_dp is on")
    warnings.filterwarnings("ignore", category=UserWarning)
    require_patched_trinity()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for algo in args.algos.split(","):
            run(algo.strip(), args, rank, world)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
