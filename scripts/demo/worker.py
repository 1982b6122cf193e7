"""torchrun entry point: train the tiny LM with PPO and/or BAPO on stale GRPO rollouts.

Every rank samples its own prompts from a policy snapshot that lags ``--staleness`` updates
behind (Trinity's async mode), scores them, computes GRPO advantages, and trains the current
policy for ``--epochs`` passes over ``--micro-batches`` micro-batches. The loss is Trinity's
engine loss, ``TrinityPolicyLoss``, called the way verl's engine calls it, with the data-parallel
group forwarded; DDP averages the gradients over ranks. Rank 0 writes one JSON line of metrics
per step to ``<out>/<algo>/metrics.jsonl``.

Run through ``scripts/bapo_demo.py``, which launches it and draws the report.
"""

import argparse
import copy
import json
import os
import sys
import time
import warnings
from collections import deque
from contextlib import nullcontext
from pathlib import Path
from typing import Dict, List

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `demo` importable

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

PPO_CLIP_LOW, PPO_CLIP_HIGH = 0.2, 0.28  # PPOPolicyLossFn ranges: ratio clipped to [0.8, 1.28]


def parse_args(argv=None) -> argparse.Namespace:
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
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
    from trinity.common.config import AlgorithmConfig

    if algo == "ppo":
        name, args = "ppo", {"clip_range_low": PPO_CLIP_LOW, "clip_range_high": PPO_CLIP_HIGH}
    elif algo == "bapo":
        name, args = "bapo", BAPOPolicyLossFn.default_args()
        if no_sync:
            args["sync_across_dp"] = False
    else:
        raise ValueError(f"unknown algorithm {algo!r}")
    return AlgorithmConfig(
        policy_loss_fn=name,
        policy_loss_fn_args=args,
        kl_loss_fn="none",
        kl_loss_fn_args={},
        entropy_loss_fn="none",
        entropy_loss_fn_args={"entropy_coef": 0.0},
        loss_agg_mode="token-mean",
    )


def bapo_start_pair() -> List[float]:
    """Where every BAPO search starts (a-, a+) under the defaults the demo uses."""
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    args = BAPOPolicyLossFn.default_args()
    return [args["ratio_lower_start"], args["ratio_upper_start"]]


def require_patched_trinity() -> None:
    """Fail early, with the fix, if the installed trinity-rft lacks the dp_group series."""
    from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFnMeta

    if "dp_group" not in getattr(PolicyLossFnMeta, "runtime_keys", ()):
        raise SystemExit(
            "the installed trinity-rft is not patched (no dp_group runtime key); "
            "run `make setup` or `.venv/bin/python scripts/trinity_patches.py apply`"
        )


class GroupSpy:
    """Stands in for the loss's policy_loss_fn and records which dp_group reached it.

    Proves that the patched TrinityPolicyLoss forwards the engine's group rather than dropping
    it; every other attribute is the real loss function's.
    """

    def __init__(self, inner, expected_group):
        self._inner, self._expected = inner, expected_group
        self.calls = self.forwarded = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.forwarded += int(kwargs.get("dp_group", None) is self._expected)
        return self._inner(*args, **kwargs)


def left_pad(rows: List[List[int]], width: int):
    from demo.task import PAD

    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def all_sum(values: List[float], group) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def all_max(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def pair_agrees(low: float, high: float, group) -> bool:
    """All-gather the clip pair a rank used and say whether every rank used the same one."""
    mine = torch.tensor([low, high], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def surrogate_sums(ratio, adv, mask, low, high):
    """Eq. 8's P and N at one pair, written independently of the code under test."""
    ratio, adv, mask = ratio.double(), adv.double(), mask.bool()
    pos = (adv > 0) & mask
    neg = (adv < 0) & mask
    p = (adv * torch.clamp(ratio, max=high))[pos].sum().item()
    n = (-adv * torch.clamp(ratio, min=low))[neg].sum().item()
    return p, n


class Rollout:
    """One step's rollout on this rank, in the engine's micro-batch layout."""

    def __init__(self, micro_batches, rewards: torch.Tensor, layout_err: float):
        self.micro_batches, self.rewards = micro_batches, rewards
        self.layout_err = layout_err  # |old_log_probs - sampler's log-probs|, max over tokens


def make_rollout(behaviour, prompts_gen, sample_gen, args, group) -> Rollout:
    from verl.workers.utils.padding import no_padding_2_padding

    from demo.batch import padded_inputs, rollout_tensordict, split_micro_batches
    from demo.policy import packed_log_probs, sample_responses
    from demo.task import PROMPT_WIDTH, group_advantages, reward, sample_prompts

    rows = sample_prompts(args.prompts_per_rank, prompts_gen)
    rows = [r for r in rows for _ in range(args.group_size)]  # a group per prompt
    prompts, prompt_mask = left_pad(rows, PROMPT_WIDTH)
    responses, response_mask, sampled_lp = sample_responses(
        behaviour, prompts, prompt_mask, sample_gen
    )
    rewards = torch.tensor([reward(p, r) for p, r in zip(rows, responses.tolist())])
    adv = group_advantages(rewards, args.group_size)[:, None] * response_mask
    zeros = torch.zeros(response_mask.shape)
    data = rollout_tensordict(prompts, prompt_mask, responses, response_mask, zeros, adv)
    with torch.no_grad():  # behaviour log-probs: what Trinity passes as old_log_probs
        ids, attn = padded_inputs(data)
        nested, _ = packed_log_probs(behaviour, ids, attn, data["input_ids"].offsets())
        data["old_log_probs"] = no_padding_2_padding(nested, data) * response_mask
    # The jagged round trip must hand back, token for token, what the sampler drew with.
    layout_err = (data["old_log_probs"] - sampled_lp).abs().max().item()
    return Rollout(split_micro_batches(data, args.micro_batches, group), rewards, layout_err)


def train_step(ddp, optimizer, loss_fn, rollout, algo, args, group) -> Dict:
    """Epochs x micro-batches on one rollout; returns this rank's raw sums and the pairs used."""
    from verl.workers.utils.padding import no_padding_2_padding

    from demo.batch import padded_inputs
    from demo.policy import packed_log_probs
    from demo.task import PROMPT_WIDTH, RESPONSE_LEN

    calls, grad_norms = [], []
    ent_sum = ent_count = 0.0
    for epoch in range(args.epochs):
        optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(rollout.micro_batches):
            last = i == len(rollout.micro_batches) - 1
            with nullcontext() if last else ddp.no_sync():
                ids, attn = padded_inputs(mb)
                nested, entropy = packed_log_probs(ddp, ids, attn, mb["input_ids"].offsets())
                loss, metrics = loss_fn(model_output={"log_probs": nested}, data=mb, dp_group=group)
                loss.backward()
            mask = mb["response_mask"].bool()
            if epoch == 0:  # the policy's entropy on this step's responses, before updating
                resp_ent = entropy[:, PROMPT_WIDTH - 1 : PROMPT_WIDTH - 1 + RESPONSE_LEN]
                ent_sum += resp_ent[mask].sum().item()
                ent_count += mask.sum().item()
            calls.append(
                call_record(
                    metrics, nested, mb, mask, algo, group, no_padding_2_padding, args.no_sync
                )
            )
        grad_norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0).item())
        optimizer.step()
    return {"calls": calls, "grad_norms": grad_norms, "ent": (ent_sum, ent_count)}


def call_record(metrics, nested, mb, mask, algo, group, unpad, no_sync) -> Dict:
    """The pair one loss call used, whether all ranks used it, and rho recomputed here."""
    if algo == "bapo":
        low, high = metrics["actor/bapo_clip_low"], metrics["actor/bapo_clip_high"]
    else:
        low, high = 1.0 - PPO_CLIP_LOW, 1.0 + PPO_CLIP_HIGH
    with torch.no_grad():
        log_ratio = (unpad(nested, mb) - mb["old_log_probs"]).clamp(-20.0, 20.0)
        p, n = surrogate_sums(log_ratio.exp(), mb["advantages"], mask, low, high)
    if not (algo == "bapo" and no_sync):  # the loss searched on the union of the ranks' tokens
        p, n = all_sum([p, n], group)
    rho_here = 1.0 if p + n == 0 else p / (p + n)
    record = {
        "low": low,
        "high": high,
        "agree": pair_agrees(low, high, group),
        "rho_independent": rho_here,
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


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def step_metrics(step, algo, lag, rollout, result, group, world, started) -> Dict:
    """Combine this rank's numbers with the other ranks' into the step's JSON line."""
    calls = result["calls"]
    local = [
        rollout.rewards.sum().item(),
        float(rollout.rewards.numel()),
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
        "logprob_layout_err": all_max(rollout.layout_err, group),
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


def run(algo: str, args, group, rank: int, world: int) -> None:
    from trinity.trainer.verl.losses import TrinityPolicyLoss

    from demo.policy import build_model

    started = time.time()
    loss_fn = TrinityPolicyLoss(algorithm_config(algo, args.no_sync))
    spy = GroupSpy(loss_fn.policy_loss_fn, group)
    loss_fn.policy_loss_fn = spy
    model = build_model(args.seed)
    behaviour = copy.deepcopy(model).eval()
    ddp = DDP(model, process_group=group)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    snapshots = deque([copy.deepcopy(model.state_dict())], maxlen=args.staleness + 1)
    prompts_gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    sample_gen = torch.Generator().manual_seed(args.seed * 1000 + 500 + rank)

    out = Path(args.out) / algo
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        sink = open(out / "metrics.jsonl", "w")
    for step in range(args.steps):
        lag = len(snapshots) - 1
        behaviour.load_state_dict(snapshots[0])  # the oldest snapshot kept
        rollout = make_rollout(behaviour, prompts_gen, sample_gen, args, group)
        result = train_step(ddp, optimizer, loss_fn, rollout, algo, args, group)
        snapshots.append(copy.deepcopy(model.state_dict()))
        row = step_metrics(step, algo, lag, rollout, result, group, world, started)
        row["dp_group_forwarded"] = spy.forwarded == spy.calls
        if rank == 0:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            if step % args.log_every == 0 or step == args.steps - 1:
                print(progress_line(row), flush=True)
    if rank == 0:
        sink.close()


def progress_line(row: Dict) -> str:
    rho = row["rho"]
    return (
        f"[{row['algo']:4s}] step {row['step']:4d}  reward {row['reward']:.3f}  "
        f"entropy {row['entropy']:.3f}  clip ({row['clip_low']:.2f}, {row['clip_high']:.2f})  "
        f"rho {rho:.3f}  clipfrac {row['pg_clipfrac']:.3f}  grad {row['grad_norm']:.2f}  "
        f"agree {row['ranks_agree']}  {row['wall_s']:.0f}s"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # A rank that gets no group would choose its own bounds; make that warning fatal here.
    # (With --no-sync the search is told not to reduce, so the warning cannot fire.)
    warnings.filterwarnings("error", message="BAPO: sync_across_dp is on")
    warnings.filterwarnings("ignore", category=UserWarning)
    require_patched_trinity()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)))  # the data-parallel group: every rank
    try:
        for algo in args.algos.split(","):
            run(algo.strip(), args, group, rank, world)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
