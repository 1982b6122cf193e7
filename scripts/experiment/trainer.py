"""Train one run (variant, seed, staleness level) and write its metrics, one JSON line a step.

A step: the rollout policy, a snapshot ``lag`` steps old, answers ``prompts`` prompts
``group_size`` times; GRPO turns the rewards into advantages; the current policy is then
trained for ``epochs`` passes over ``mini_batches`` mini-batches, one optimizer update each, so
the data grow staler with every update. ``old_log_probs`` are the rollout policy's own
log-probs, so the ratio measures that staleness, as in Trinity's asynchronous mode. Every loss
goes through Trinity's engine loss, ``TrinityPolicyLoss``, called as verl's engine calls it,
with the data-parallel group forwarded. After the update, the current policy answers a fixed
set of evaluation prompts afresh; that reward and its token entropy are the step's figures.
"""

import copy
import json
import time
from collections import deque
from pathlib import Path
from typing import Dict, List, NamedTuple

import torch
from tensordict import TensorDict
from verl.workers.utils.padding import no_padding_2_padding

from demo.loss import GroupSpy, loss_config, surrogate_sums
from demo.policy import build_model, sample_responses
from demo.task import group_advantages, left_pad, sample_prompts
from experiment.policy import packed_log_probs
from experiment.task import (
    MAX_POSITIONS,
    PROMPT_MAX,
    PROMPT_MIN,
    PROMPT_WIDTH,
    RESPONSE_LEN,
    REWARDS,
    goal_tokens,
)
from experiment.variants import Variant

GRAD_CLIP = 1.0  # verl's default actor grad_clip


class Setting(NamedTuple):
    """Everything but the variant and the seed that a run depends on."""

    level: str
    task: str  # "stop" or "cover" (see experiment.task)
    lag: int  # training steps the rollout policy lags behind
    epochs: int
    steps: int
    prompts: int = 8
    group_size: int = 8
    mini_batches: int = 2
    lr: float = 3e-3
    eval_prompts: int = 64


def rollout(behaviour, gens, setting: Setting):
    """One step's batch as Trinity's trainer hands it to verl (padded fields), plus stats."""
    rows = sample_prompts(setting.prompts, gens["prompts"], (PROMPT_MIN, PROMPT_MAX))
    rows = [r for r in rows for _ in range(setting.group_size)]
    prompts, prompt_mask = left_pad(rows, PROMPT_WIDTH)
    goal = goal_tokens(rows) if setting.task == "cover" else None
    responses, response_mask, _, _ = sample_responses(
        behaviour, prompts, prompt_mask, gens["sample"], goal, RESPONSE_LEN
    )
    rewards = torch.tensor(scores(setting.task, rows, responses, response_mask))
    adv = group_advantages(rewards, setting.group_size)[:, None] * response_mask
    data = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "response_mask": response_mask,
            "advantages": adv,
        },
        batch_size=[len(rows)],
    )
    with torch.no_grad():
        nested = packed_log_probs(behaviour, *model_inputs(data))
        data["old_log_probs"] = no_padding_2_padding(nested, data) * response_mask
    return data, imbalance(rewards, adv, response_mask)


def scores(task: str, rows, responses: torch.Tensor, mask: torch.Tensor) -> List[float]:
    """The task's reward of every response (its tokens under the mask)."""
    lengths = mask.sum(dim=1).tolist()
    return [REWARDS[task](p, r[:n]) for p, r, n in zip(rows, responses.tolist(), lengths)]


def model_inputs(data: TensorDict):
    """Padded ids (prompt left-, response right-padded) and attention mask."""
    return torch.cat([data["prompts"], data["responses"]], dim=1), data["attention_mask"]


def imbalance(rewards: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> Dict:
    """How much of the batch negative advantages carry, by tokens and by |A| mass."""
    mask = mask.bool()
    neg, pos = (adv < 0) & mask, (adv > 0) & mask
    signed = neg.sum() + pos.sum()
    mass_neg, mass_pos = adv[neg].abs().sum(), adv[pos].sum()
    lengths = mask.sum(dim=1).float()
    seq_adv = adv[:, 0]
    return {
        "rollout_reward": rewards.mean().item(),
        "neg_token_share": (neg.sum() / signed).item() if signed else None,
        "neg_mass_share": (mass_neg / (mass_neg + mass_pos)).item() if signed else None,
        "len_pos": lengths[seq_adv > 0].mean().item() if (seq_adv > 0).any() else None,
        "len_neg": lengths[seq_adv < 0].mean().item() if (seq_adv < 0).any() else None,
        "truncated_share": (rewards.eq(0) & mask[:, -1]).float().mean().item(),
    }


def surrogate_rho(data: TensorDict, log_prob: torch.Tensor, low: float, high: float) -> float:
    """Eq. 8's P / (P + N) at one pair, written here apart from the loss (a cross-check)."""
    ratio = (log_prob.detach().double() - data["old_log_probs"].double()).clamp(-20, 20).exp()
    p, n = surrogate_sums(ratio, data["advantages"], data["response_mask"], low, high)
    return 1.0 if p + n == 0 else p / (p + n)


def loss_call(loss_fn, model, mb: TensorDict, variant: Variant, group) -> Dict:
    """One loss call as the engine makes it; returns the pair used and rho."""
    nested = packed_log_probs(model, *model_inputs(mb))
    loss, metrics = loss_fn(model_output={"log_probs": nested}, data=mb, dp_group=group)
    loss.backward()
    if variant.loss == "bapo":
        low, high = metrics["actor/bapo_clip_low"], metrics["actor/bapo_clip_high"]
        rho = metrics["actor/bapo_positive_contribution"]
    else:
        low, high = 1.0 - variant.args["clip_range_low"], 1.0 + variant.args["clip_range_high"]
        rho = None
    rho_surrogate = surrogate_rho(mb, no_padding_2_padding(nested, mb), low, high)
    return {
        "low": low,
        "high": high,
        "rho": rho_surrogate if rho is None else rho,
        "rho_surrogate": rho_surrogate,
        "moved": [low, high] != variant.start,
        "clipfrac": metrics["actor/pg_clipfrac"],
    }


@torch.no_grad()
def evaluate(model, prompts, prompt_mask, rows, generator, task: str) -> Dict:
    """Reward and token entropy of the current policy, on fresh samples."""
    goal = goal_tokens(rows) if task == "cover" else None
    responses, mask, _, entropy = sample_responses(
        model, prompts, prompt_mask, generator, goal, RESPONSE_LEN
    )
    rewards = scores(task, rows, responses, mask)
    return {
        "reward": sum(rewards) / len(rewards),
        "entropy": (entropy.sum() / mask.sum()).item(),
        "length": mask.sum(dim=1).float().mean().item(),
    }


def train(variant: Variant, seed: int, setting: Setting, out: Path, group) -> Dict:
    """Run one configuration to the end; write ``out/metrics.jsonl``; return a summary."""
    from trinity.trainer.verl.losses import TrinityPolicyLoss

    started = time.time()
    loss_fn = TrinityPolicyLoss(loss_config(variant.loss, dict(variant.args)))
    check = loss_fn.policy_loss_fn = GroupSpy(loss_fn.policy_loss_fn, group)
    model = build_model(seed, MAX_POSITIONS)
    behaviour = copy.deepcopy(model).eval()
    optimizer = torch.optim.Adam(model.parameters(), lr=setting.lr)
    snapshots = deque([copy.deepcopy(model.state_dict())], maxlen=setting.lag + 1)
    gens = {
        k: torch.Generator().manual_seed(seed * 1000 + i)
        for i, k in enumerate(("prompts", "sample", "eval_prompts", "eval_sample"))
    }
    eval_rows = sample_prompts(setting.eval_prompts, gens["eval_prompts"], (PROMPT_MIN, PROMPT_MAX))
    eval_ids, eval_mask = left_pad(eval_rows, PROMPT_WIDTH)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as sink:
        for step in range(setting.steps):
            lag = len(snapshots) - 1  # steps between the rollout policy and this one
            behaviour.load_state_dict(snapshots[0])
            data, stats = rollout(behaviour, gens, setting)
            calls, norms = [], []
            for _ in range(setting.epochs):
                for mb in data.chunk(setting.mini_batches):
                    optimizer.zero_grad(set_to_none=True)
                    calls.append(loss_call(loss_fn, model, mb, variant, group))
                    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP))
                    optimizer.step()
            snapshots.append(copy.deepcopy(model.state_dict()))
            fresh = evaluate(
                model, eval_ids, eval_mask, eval_rows, gens["eval_sample"], setting.task
            )
            row = step_row(step, lag, calls, norms, fresh, stats)
            row["dp_group_forwarded"] = check.forwarded == check.calls
            sink.write(json.dumps(row) + "\n")
    return {
        "variant": variant.name,
        "seed": seed,
        "level": setting.level,
        "steps": setting.steps,
        "wall_s": round(time.time() - started, 1),
    }


def step_row(step, lag, calls, norms, fresh, stats) -> Dict:
    """The step's JSON line: fresh reward and entropy, the pairs, rho, moves, grad norm."""
    n = len(calls)
    return {
        "step": step,
        "lag": lag,
        **fresh,
        **stats,
        "pairs": [[c["low"], c["high"]] for c in calls],
        "rho": sum(c["rho"] for c in calls) / n,
        "rho_surrogate": sum(c["rho_surrogate"] for c in calls) / n,
        "moved": any(c["moved"] for c in calls),
        "moved_calls": sum(c["moved"] for c in calls),
        "clipfrac": sum(c["clipfrac"] for c in calls) / n,
        "grad_norm": sum(float(g) for g in norms) / len(norms),
    }
