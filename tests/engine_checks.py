"""Checks inside verl 0.8's FSDP engine, run on every rank as ``python -m tests.engine_checks``.

- ``fsdp2`` and ``fsdp1`` (options ``sp``, ``phases``, ``released_losses``, ``grads``): every
  rank builds ``FSDPEngineWithLMHead`` on one tiny Llama and trains ``engine.train_batch`` steps
  through ``TrinityPolicyLoss`` around ``bapo``; the engine alone picks the micro-batches and the
  group. Phases: ``sync``, ``authors`` (their order and grid), ``nosync``, ``released`` (the
  released ``losses.py``, which drops the group) and ``muted`` (BAPO's all-reduce a no-op): the
  controls must disagree. With ``grads`` (FSDP2 only), the gradient the engine hands its
  optimizer is compared with one process's oracle gradient (``grad_oracle``). The phases of
  ``UPDATE_PHASES`` train with ``search_scope: update`` through the actor worker's own method
  around each optimizer update, as ``set_trinity_config`` routes the actor's ``train_batch``.
- ``worker`` (options ``config_true``, ``config_false``, ``config_update``): a Trinity trainer
  rank minus Ray, from each YAML to one ``update_actor`` on this rank's share of a batch; after
  the ``update`` run the same worker is set PPO and updates once more.
"""

import importlib.util
import math
import sys
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from scripts.harness.cpu import cpu_stand_ins
from scripts.harness.engine import (
    build_engine,
    engine_batch,
    full_state_dict,
    trinity_layout,
    worker_actor,
)
from scripts.harness.model import build_model, position_ids_for, save_model
from scripts.harness.recorder import LossRecorder
from scripts.harness.tasks import VOCAB_SIZE
from scripts.harness.variants import loss_config
from tests.inputs import chosen, loss_kwargs, point
from tests.ranks import main, outcome
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

STEPS, MICRO_BATCH = 2, 4  # train_batch calls per phase, sequences per micro-batch
# Phase: (sync_across_dp, a config of tests.inputs.CONFIGS, the released losses.py)
PHASES = {
    "sync": (True, "paper_upper", False),
    "authors": (True, "yaml_lower", False),
    "nosync": (False, "paper_upper", False),
    "released": (True, "paper_upper", True),
    "muted": (True, "paper_upper", False),
}
# Per-update phases (``search_scope: update``): a config, sequences per micro-batch (0: dynamic
# batch sizes, at most DYNAMIC_TOKENS tokens per micro-batch), arguments changed (the paper's
# grid with a target of 0.5, which this data moves).
UPPER = ("paper_upper", {"positive_contribution_target": 0.5})
UPDATE_PHASES = {
    f"update_{order}_{size or 'dynamic'}": (name, size, extra)
    for order, (name, extra) in (("upper", UPPER), ("lower", ("yaml_lower", {})))
    for size in (1, 2, 4, 0)
}
DYNAMIC_TOKENS = 40
MUTED = {"muted"}  # phases whose BAPO calls find torch.distributed.all_reduce a no-op
GRAD_PHASES = ("sync", "authors", "nosync", "muted")  # phases whose gradients ``grads`` checks
BATCH, WIDTH = 8, 6  # sequences per data-parallel rank and step; prompt and response width
# Share of positive sequences per data-parallel rank: apart, so that alone they choose apart.
POSITIVE_SHARE = (0.75, 0.15, 0.5, 0.3)


def rank_batch(dp_rank: int, step: int) -> TensorDict:
    """One data-parallel rank's batch in Trinity's layout: one advantage per sequence."""
    return trinity_layout(*rank_fields(dp_rank, step).values())


def rank_fields(dp_rank: int, step: int) -> Dict[str, torch.Tensor]:
    """The padded fields of ``rank_batch``: prompts (left-padded), responses (right-padded).

    Odd ranks hold longer sequences; old log-probs spread the ratios over both clip ranges.
    """
    gen = torch.Generator().manual_seed(1000 * dp_rank + step)
    low = 2 if dp_rank % 2 == 0 else 4
    prompt_len, response_len = torch.randint(low, low + 3, (2, BATCH), generator=gen)
    columns = torch.arange(WIDTH)
    prompt_mask = (columns >= WIDTH - prompt_len[:, None]).long()
    response_mask = (columns < response_len[:, None]).long()
    prompts, responses = torch.randint(1, VOCAB_SIZE, (2, BATCH, WIDTH), generator=gen)
    share = POSITIVE_SHARE[dp_rank % len(POSITIVE_SHARE)]
    sign = torch.where(torch.rand(BATCH, generator=gen) < share, 1.0, -1.0)
    advantages = (sign * (torch.rand(BATCH, generator=gen) + 0.2))[:, None] * response_mask
    old = -(torch.rand(BATCH, WIDTH, generator=gen) * 2.5 + 1.5) * response_mask
    prompts, responses = prompts * prompt_mask, responses * response_mask
    fields = dict(prompts=prompts, prompt_mask=prompt_mask, responses=responses)
    return dict(fields, response_mask=response_mask, old=old, advantages=advantages)


def loss_class(path):
    """``TrinityPolicyLoss`` from the installed module, or from a file (the released copy)."""
    if not path:
        from trinity.trainer.verl.losses import TrinityPolicyLoss

        return TrinityPolicyLoss
    spec = importlib.util.spec_from_file_location("released_trinity_losses", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.TrinityPolicyLoss


class MutedAllReduce:
    """A policy loss during whose calls ``torch.distributed.all_reduce`` does nothing (a control).

    The engine's own collectives, outside the loss's calls, are left alone.
    """

    def __init__(self, inner):
        """Wrap the policy loss ``inner``."""
        self.inner = inner

    def __getattr__(self, name):
        """Everything else is the real loss's."""
        return getattr(self.inner, name)

    def __call__(self, **kwargs):
        """Call the real loss with a no-op all-reduce."""
        real = dist.all_reduce
        dist.all_reduce = lambda *args, **kw: None
        try:
            return self.inner(**kwargs)
        finally:
            dist.all_reduce = real


def full_grads(module) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient, whole on every rank (FSDP2 holds shards: DTensors)."""
    grads = {}
    for name, param in module.named_parameters():
        grad = param.grad
        if grad is not None:
            grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
    return grads


def spy_optimizer_step(engine, grads: list) -> None:
    """Note what the optimizer gets at every step: after FSDP's reduction, before clipping."""
    step_fn = engine.optimizer_step

    def optimizer_step():
        grads.append(full_grads(engine.module))
        return step_fn()

    engine.optimizer_step = optimizer_step


def run_phase(engine, phase: str, options: dict, dp_rank: int, grads_on=False) -> dict:
    """Train ``STEPS`` batches with one phase's loss; return what BAPO saw (and the gradients)."""
    if phase in UPDATE_PHASES:
        return run_update_phase(engine, phase, dp_rank, grads_on)
    sync, name, released = PHASES[phase]
    loss = loss_class(released and options["released_losses"])(
        loss_config("bapo", loss_kwargs(name, sync_across_dp=sync))
    )
    if phase in MUTED:
        loss.policy_loss_fn = MutedAllReduce(loss.policy_loss_fn)
    recorder = LossRecorder(loss, engine.get_data_parallel_group(), keep_inputs=True)
    grads, states = list[dict](), list[dict]()
    check_grads = grads_on and phase in GRAD_PHASES
    if check_grads:
        spy_optimizer_step(engine, grads)
    for step in range(STEPS):
        data = engine_batch(rank_batch(dp_rank, step), MICRO_BATCH, options["sp"] != "1")
        if check_grads:
            states.append(full_state_dict(engine))
        with engine.train_mode():
            engine.train_batch(data, loss_function=loss)
    record: dict = {"config": name, "calls": recorder.calls}
    if check_grads:
        del engine.optimizer_step  # the class's method again
        record["grads"] = grad_oracle(name, states, grads, recorder.calls)
    for call in recorder.calls:
        call["data"] = {key: value.tolist() for key, value in call.pop("inputs").items()}
    return record


def run_update_phase(engine, phase: str, dp_rank: int, grads_on: bool) -> dict:
    """Train ``STEPS`` updates with ``search_scope: update``, through the worker's method."""
    name, size, extra = UPDATE_PHASES[phase]
    kwargs = loss_kwargs(name, search_scope="update", **extra)
    actor = worker_actor(engine, loss_config("bapo", kwargs))
    loss = actor.loss_fn
    recorder = LossRecorder(loss, engine.get_data_parallel_group(), keep_inputs=True)
    grads, states, outcomes = list[dict](), list[dict](), list[dict]()
    check_grads = grads_on and size > 0
    if check_grads:
        spy_optimizer_step(engine, grads)
    for step in range(STEPS):
        batch = rank_batch(dp_rank, step)
        data = engine_batch(batch, size or BATCH)
        if size == 0:
            tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=DYNAMIC_TOKENS)
        if check_grads:
            states.append(full_state_dict(engine))
        with engine.train_mode():
            outcomes.append(outcome(lambda: actor.train_batch(data) and None))
        outcomes[-1]["calls"] = len(recorder.calls) - sum(o["calls"] for o in outcomes[:-1])
    engine.__dict__.pop("optimizer_step", None)  # the class's method again
    record: dict = {"config": name, "calls": recorder.calls, "outcomes": outcomes}
    record["pass_calls"] = len(recorder.pass_calls)
    if check_grads:
        record["grads"] = grad_oracle(name, states, grads, recorder.calls, size, extra)
    for call in recorder.calls:
        call["data"] = {key: value.tolist() for key, value in call.pop("inputs").items()}
    return record


def response_log_probs(model, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The plain model's log-probs of a padded batch's response tokens, [rows, WIDTH]."""
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    positions = position_ids_for(mask)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    log_probs = torch.log_softmax(out.logits[:, WIDTH - 1 : -1].float(), dim=-1)
    return log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def ppo_clip(name: str, pair, log_probs, batch) -> torch.Tensor:
    """PPO-clip at ``pair``: BAPO with both ranges collapsed there, alone (no sync)."""
    fixed = BAPOPolicyLossFn(**loss_kwargs(name, **point(*pair), sync_across_dp=False))
    return fixed(
        logprob=log_probs,
        old_logprob=batch["old"],
        action_mask=batch["response_mask"],
        advantages=batch["advantages"],
    )[0]


def micro_batches(fields: Dict[str, torch.Tensor], size: int) -> List[Dict[str, torch.Tensor]]:
    """A rank's padded fields cut as the engine cuts its batch: ``size`` rows at a time."""
    return [
        {key: value[i : i + size] for key, value in fields.items()} for i in range(0, BATCH, size)
    ]


def grad_oracle(name, states, grads, calls, size=MICRO_BATCH, per_update=None) -> List[dict]:
    """Per step, the engine's gradient against one process's, with no FSDP and no group.

    verl 0.8 (``FSDPEngine.forward_backward_batch``) runs ``loss.backward()`` on the value each
    micro-batch's ``TrinityPolicyLoss`` returns; it only puts ``batch_num_tokens`` and ``dp_size``
    beside the batch, and Trinity 0.6.0's loss ignores them and returns the micro-batch's own
    token-mean. FSDP2 then averages the ranks' summed gradients (reduce-scatter, ReduceOp.AVG).
    So the optimizer gets, for D = dp_size ranks of K micro-batches each,

        g = (1 / D) * sum_{r < D} sum_{k < K} grad loss(micro-batch (r, k); c_low_k, c_high_k)

    with PPO-clip at the pair chosen on call k. The oracle computes ``g`` in one process from a
    plain model holding the step's weights, once with the pairs one process chooses on the
    union of every rank's micro-batch k (``union``), once with each rank's recorded pairs
    (``own``). It also reports its log-probs against those the loss received. ``per_update``
    (arguments changed, maybe none): the union is that of all the step's micro-batches, one
    pair for every call, as under ``search_scope: update``.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, [chosen(call["metrics"])[:2] for call in calls])
    model = build_model(0, hidden=32)
    searching = BAPOPolicyLossFn(**loss_kwargs(name, sync_across_dp=False, **(per_update or {})))
    out = []
    for step, (state, got) in enumerate(zip(states, grads)):
        model.load_state_dict(state)
        count = BATCH // size  # the engine's split: ``size`` consecutive rows per micro-batch
        batches = [micro_batches(rank_fields(r, step), size) for r in range(world)]
        log_probs = [[response_log_probs(model, b) for b in mbs] for mbs in batches]
        lp_diff = 0.0
        for k in range(count):
            call = calls[step * count + k]["inputs"]  # this rank's own call k
            mask = call["mask"].bool()
            assert torch.equal(call["old_logprob"][mask], batches[rank][k]["old"][mask])
            lp_diff = max(lp_diff, float((call["logprob"] - log_probs[rank][k])[mask].abs().max()))
        union_pairs: list = []
        for ks in [range(count)] if per_update is not None else [[k] for k in range(count)]:
            parts = [(r, k) for r in range(world) for k in ks]
            union = {
                f: torch.cat([batches[r][k][f] for r, k in parts])
                for f in ("old", "advantages", "response_mask")
            }
            metrics = searching(
                logprob=torch.cat([log_probs[r][k] for r, k in parts]).detach(),
                old_logprob=union["old"],
                action_mask=union["response_mask"],
                advantages=union["advantages"],
            )[1]
            union_pairs += [chosen(metrics)[:2]] * len(ks)
        record: dict = {"union_pairs": union_pairs, "log_prob_max_abs": lp_diff}
        scale = max(float(g.abs().max()) for g in got.values())
        record["engine_max_abs"] = scale
        for kind in ("union", "own"):
            model.zero_grad()
            total = sum(
                ppo_clip(
                    name,
                    union_pairs[k] if kind == "union" else per_rank[r][step * count + k],
                    response_log_probs(model, batches[r][k]),
                    batches[r][k],
                )
                for r in range(world)
                for k in range(count)
            )
            (total / world).backward()  # type: ignore[union-attr]
            want = dict(model.named_parameters())
            assert set(want) == set(got), (sorted(want), sorted(got))
            diff = max(float((got[n] - p.grad).abs().max()) for n, p in want.items())
            record[kind] = {"max_abs": diff, "max_rel": diff / scale}
        out.append(record)
    return out


def engine_check(strategy: str, phases: str):
    """A check that builds the engine of ``strategy`` once and runs ``phases`` (default: option)."""

    def check(ctx) -> dict:
        options = ctx.options
        cpu_stand_ins(fsdp1=strategy == "fsdp")
        model_dir = save_model(build_model(0, hidden=32), Path(options["out"]) / "model")
        engine = build_engine(model_dir, strategy, sp_size=int(options["sp"]))
        dp_rank = engine.get_data_parallel_rank()
        names = (phases or options["phases"]).split(",")
        # FSDP2's gradients are DTensors, whole through full_tensor(); FSDP1's are flat shards
        grads_on = strategy == "fsdp2" and options.get("grads") == "1"
        assert not (grads_on and options["sp"] != "1"), "the gradient oracle has no SP"
        return {p: run_phase(engine, p, options, dp_rank, grads_on) for p in names}

    return check


def trainer_batch(rank: int, config) -> TensorDict:
    """This rank's share of a batch, with the fields Trinity's ``_update_actor`` adds."""
    from verl.utils import tensordict_utils as tu

    data, size = rank_batch(rank, step=0), config.buffer.train_batch_size
    tu.assign_non_tensor(
        data,
        calculate_entropy=False,
        global_batch_size=size,
        mini_batch_size=size,
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
        temperature=1.0,
        compute_loss=True,
    )
    return data


def check_worker(ctx) -> dict:
    """Each config file to ``update_actor`` on this rank; returns what the driver checks."""
    runs = ("true", "false", "update")  # sync on, off, on with ``search_scope: update``
    return {run: run_worker(ctx.rank, ctx.options[f"config_{run}"]) for run in runs}


def run_worker(rank: int, path: str) -> dict:
    """One config file to one ``update_actor`` on this rank."""
    from trinity.common.config import load_config
    from trinity.trainer.verl.config import build_verl_config
    from trinity.trainer.verl.workers import TrinityActorRolloutRefWorker

    cpu_stand_ins(worker=True)
    save_model(build_model(0, hidden=32), Path(path).parent / "model")
    config = load_config(path).check_and_update()
    worker = TrinityActorRolloutRefWorker(build_verl_config(config), role="actor")
    worker.init_model()
    worker.set_trinity_config(config.algorithm, rollout_engine_type="vllm", ray_namespace="")
    loss = worker.actor.loss_fn
    recorder = LossRecorder(loss, keep_inputs=True)
    data = trainer_batch(rank, config)
    # the micro-batches this rank's tokens need alone, as verl's dynamic batching counts them
    tokens = int(data["attention_mask"].sum())
    own_count = min(len(data), math.ceil(tokens / (config.trainer.max_token_len_per_gpu or tokens)))
    metrics = worker.update_actor(data).get_non_tensor("metrics")
    for call in recorder.calls:
        call["data"] = {key: value.tolist() for key, value in call.pop("inputs").items()}
    after = None
    if (config.algorithm.policy_loss_fn_args or {}).get("search_scope") == "update":
        after = outcome(lambda: ppo_after_bapo(worker, trainer_batch(rank, config)))
    return {
        "ppo_after": after,
        "engine_group": dist.get_process_group_ranks(worker.actor.engine.get_data_parallel_group()),
        "loss_class": type(loss).__name__,
        "sync_across_dp": recorder.sync_across_dp,
        "calls": recorder.calls,
        "pass_calls": len(recorder.pass_calls),
        "own_micro_batches": own_count,
        "metrics": {k: v for k, v in metrics.items() if "bapo" in k or k.startswith("pg_")},
    }


def ppo_after_bapo(worker, data) -> List[str]:
    """PPO set on the worker that trained BAPO per update, and one update: its metric names."""
    worker.set_trinity_config(loss_config("ppo", {"clip_range": 0.2}), "vllm", "")
    return sorted(worker.update_actor(data).get_non_tensor("metrics"))


CHECKS = {
    "fsdp2": engine_check("fsdp2", ""),
    "fsdp1": engine_check("fsdp", "sync"),
    "worker": check_worker,
}

if __name__ == "__main__":
    sys.exit(main(CHECKS))
