"""The checks of ``tests/test_bapo_distributed.py``, run on every rank by the harness's DP worker.

``python -m torch.distributed.run --nproc_per_node=N -m scripts.harness.dp_worker checks --out
DIR --checks a,b,...`` (with ``tests/`` on ``PYTHONPATH``) runs the named checks in order; each
returns what it computed and the data it used, and the pytest driver recomputes the
single-process answer on the union of the ranks' data and asserts. Nothing expected lives
here. The per-rank data builders are here too, so that the driver rebuilds what each rank saw.
"""

import warnings
from typing import Dict, List

import torch
import torch.distributed as dist
from tensordict import TensorDict

from scripts.harness.cases import PAPER
from scripts.harness.dp_worker import _plain, call_bapo, counted_call, run_record
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

PROMPT_WIDTH = 4

# Search settings exercised by every check: both orders x both contribution definitions, on the
# paper's grid and on the authors' grids (their yaml, and their run script whose 0.95 / 2.0
# ends are reached only through the ``min(c + step, max)`` cap).
CONFIGS: Dict[str, Dict] = {
    "paper_upper_surrogate": dict(search_order="upper_first", contribution="surrogate"),
    "paper_upper_gradient": dict(search_order="upper_first", contribution="gradient"),
    "paper_lower_surrogate": dict(search_order="lower_first", contribution="surrogate"),
    "paper_lower_gradient": dict(search_order="lower_first", contribution="gradient"),
    "yaml_lower_surrogate": dict(
        search_order="lower_first",
        contribution="surrogate",
        ratio_lower_start=0.6,
        ratio_lower_max=0.8,
        ratio_lower_step=0.05,
        ratio_upper_start=1.2,
        ratio_upper_max=2.0,
        ratio_upper_step=0.05,
        positive_contribution_target=0.5,
    ),
    "script_lower_gradient": dict(
        search_order="lower_first",
        contribution="gradient",
        ratio_lower_start=0.8,
        ratio_lower_max=0.95,
        ratio_lower_step=0.1,
        ratio_upper_start=1.2,
        ratio_upper_max=2.0,
        ratio_upper_step=0.3,
        positive_contribution_target=1 / 3,
    ),
}


def loss_kwargs(name: str, **extra) -> Dict:
    """Full BAPOPolicyLossFn keyword arguments of one named config."""
    return {**PAPER, **CONFIGS[name], **extra}


CASES = ("mixed", "one_empty", "signs")

# Per-rank share of positive advantages in the "mixed" case (ranks beyond 4 reuse these).
_POSITIVE_SHARE = (0.45, 0.2, 0.7, 0.3)
_LOG_RATIO_SHIFT = (0.1, -0.1, 0.25, 0.0)


def _case_seed(seed: int, case: str, rank: int) -> int:
    return seed * 10_000 + CASES.index(case) * 100 + rank


def make_case(case: str, rank: int, world: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """One rank's padded micro-batch for ``case``; differs in shape and sign mix per rank.

    - ``mixed``: every rank has both signs, in different proportions.
    - ``one_empty``: as ``mixed`` but the last rank's response mask is all zero (its values are
      wild on purpose: a rank that leaks masked tokens into the sums is caught).
    - ``signs``: rank 0 only positive advantages, rank 1 only negative, the rest mixed.

    Returns float32 ``logprob``, ``old_logprob``, ``advantages``, an int ``mask`` and the
    per-row response lengths ``response_len`` (the mask is zero beyond them, as padding is).
    """
    gen = torch.Generator().manual_seed(_case_seed(seed, case, rank))
    rows, width = 3 + rank, 6 + 3 * rank
    response_len = torch.randint(width // 2, width + 1, (rows,), generator=gen)
    response_len[0] = width  # at least one row fills the padded width
    inside = torch.arange(width).unsqueeze(0) < response_len.unsqueeze(1)
    mask = inside & (torch.rand(rows, width, generator=gen) > 0.15)

    share = _POSITIVE_SHARE[rank % len(_POSITIVE_SHARE)]
    if case == "signs" and rank < 2:
        share = 1.0 if rank == 0 else 0.0
    positive = torch.rand(rows, width, generator=gen) < share
    magnitude = torch.randn(rows, width, generator=gen).abs() + 0.05
    advantages = torch.where(positive, magnitude, -magnitude)

    old_logprob = -(torch.rand(rows, width, generator=gen) * 2.0 + 0.1)
    shift = _LOG_RATIO_SHIFT[rank % len(_LOG_RATIO_SHIFT)]
    log_ratio = torch.randn(rows, width, generator=gen) * 0.5 + shift
    if case == "one_empty" and rank == world - 1:
        mask = torch.zeros_like(mask)
        log_ratio = log_ratio * 10.0  # ratios far outside every range, all masked
        advantages = -advantages.abs() * 100.0
    return {
        "logprob": (old_logprob + log_ratio).float(),
        "old_logprob": old_logprob.float(),
        "advantages": advantages.float(),
        "mask": mask.to(torch.int64),
        "response_len": response_len,
    }


def case_to_lists(data: Dict[str, torch.Tensor]) -> Dict[str, List]:
    """JSON-friendly copy (floats survive the round trip exactly)."""
    return {key: value.tolist() for key, value in data.items()}


def lists_to_case(data: Dict[str, List]) -> Dict[str, torch.Tensor]:
    """Turn a case's JSON lists back into tensors."""
    return {
        "logprob": torch.tensor(data["logprob"], dtype=torch.float32),
        "old_logprob": torch.tensor(data["old_logprob"], dtype=torch.float32),
        "advantages": torch.tensor(data["advantages"], dtype=torch.float32),
        "mask": torch.tensor(data["mask"], dtype=torch.int64),
    }


# --------------------------------------------------------------------------- tiny policy

VOCAB, WIDTH = 7, 3
TOKENS_PER_RANK = 24  # equal on every rank, so the mean of per-rank token-means is the union's
_GRAD_SHAPES = ((4, 8), (3, 10), (5, 6), (6, 5))
_GRAD_POSITIVE_SHARE = (1.0, 0.0, 0.5, 0.3)  # rank 0 all positive, rank 1 all negative


def tiny_policy_params(seed: int = 0) -> Dict[str, torch.Tensor]:
    """Embedding + output matrix of a bigram policy, float64 so sums agree to ~1e-12."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(VOCAB, WIDTH, generator=gen, dtype=torch.float64) * 0.7,
        "out": torch.randn(WIDTH, VOCAB, generator=gen, dtype=torch.float64) * 0.7,
    }


def tiny_policy_logprob(params: Dict[str, torch.Tensor], prev: torch.Tensor, target: torch.Tensor):
    """Return log pi(target | prev) for every position."""
    logits = params["embed"][prev] @ params["out"]
    return torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


def make_policy_batch(rank: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A rank's tokens for the gradient check: its own shape, exactly TOKENS_PER_RANK unmasked.

    ``log_ratio`` is the wanted log-ratio; the old log-prob is the current one minus it, so the
    ratios spread over [0.4, 2.5] whatever the parameters are.
    """
    gen = torch.Generator().manual_seed(seed * 1000 + 17 + rank)
    rows, width = _GRAD_SHAPES[rank % len(_GRAD_SHAPES)]
    order = torch.randperm(rows * width, generator=gen)
    mask = torch.zeros(rows * width, dtype=torch.int64)
    mask[order[:TOKENS_PER_RANK]] = 1
    share = _GRAD_POSITIVE_SHARE[rank % len(_GRAD_POSITIVE_SHARE)]
    positive = torch.rand(rows, width, generator=gen) < share
    magnitude = torch.rand(rows, width, generator=gen, dtype=torch.float64) + 0.1
    return {
        "prev": torch.randint(0, VOCAB, (rows, width), generator=gen),
        "target": torch.randint(0, VOCAB, (rows, width), generator=gen),
        "log_ratio": (torch.rand(rows, width, generator=gen, dtype=torch.float64) - 0.5) * 1.8,
        "advantages": torch.where(positive, magnitude, -magnitude),
        "mask": mask.reshape(rows, width),
    }


# --------------------------------------------------------------------------- engine batches

ENGINE_BATCH = 8  # sequences per data-parallel rank and step
ENGINE_WIDTH = 6  # prompt and response width
# Per data-parallel rank share of sequences with a positive advantage: rank 0 mostly positive,
# rank 1 mostly negative, so a rank that searched alone would pick another pair.
ENGINE_POSITIVE_SHARE = (0.75, 0.15, 0.5, 0.3)


def engine_rank_batch(dp_rank: int, step: int) -> TensorDict:
    """One data-parallel rank's batch for one step, in Trinity's layout for the actor.

    Prompts are left-padded, responses right-padded, with lengths 2 to 4 on even ranks and 4 to
    6 on odd ones; every sequence has one advantage (GRPO-like) whose sign follows the rank's
    share; old log-probs spread so that the ratios to the model's log-probs cover both clip
    ranges.
    """
    from scripts.harness.engine import trinity_layout
    from scripts.harness.tasks import VOCAB_SIZE

    gen = torch.Generator().manual_seed(1000 * dp_rank + step)
    low = 2 if dp_rank % 2 == 0 else 4  # odd ranks hold longer sequences, so more tokens
    prompt_len = torch.randint(low, low + 3, (ENGINE_BATCH,), generator=gen)
    response_len = torch.randint(low, low + 3, (ENGINE_BATCH,), generator=gen)
    columns = torch.arange(ENGINE_WIDTH)
    prompt_mask = (columns >= ENGINE_WIDTH - prompt_len[:, None]).long()
    response_mask = (columns < response_len[:, None]).long()
    prompts = torch.randint(1, VOCAB_SIZE, (ENGINE_BATCH, ENGINE_WIDTH), generator=gen)
    responses = torch.randint(1, VOCAB_SIZE, (ENGINE_BATCH, ENGINE_WIDTH), generator=gen)
    share = ENGINE_POSITIVE_SHARE[dp_rank % len(ENGINE_POSITIVE_SHARE)]
    sign = torch.where(torch.rand(ENGINE_BATCH, generator=gen) < share, 1.0, -1.0)
    advantages = (sign * (torch.rand(ENGINE_BATCH, generator=gen) + 0.2))[:, None] * response_mask
    old = -(torch.rand(ENGINE_BATCH, ENGINE_WIDTH, generator=gen) * 2.5 + 1.5) * response_mask
    return trinity_layout(
        prompts * prompt_mask,
        prompt_mask,
        responses * response_mask,
        response_mask,
        old,
        advantages,
    )


# --------------------------------------------------------------------------- the checks


def check_group_none(ctx):
    """Sync on, no group, world > 1: one RuntimeWarning over two calls, and a local choice.

    Runs first in its process, since the warning is emitted once per process.
    """
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**loss_kwargs("paper_upper_surrogate"))
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            calls.append(call_bapo(ctx, loss_fn, data, None))
    return {
        "data": case_to_lists(data),
        "calls": calls,
        "warnings": [{"category": w.category.__name__, "message": str(w.message)} for w in caught],
    }


def check_oracle(ctx):
    """Every case x config through BAPOPolicyLossFn with dp_group=WORLD.

    One loss per config serves every case, in order, so that the first case's calls are the
    first on the group and the later ones show what each call after it costs.
    """
    losses = {name: BAPOPolicyLossFn(**loss_kwargs(name)) for name in CONFIGS}
    out = {}
    for case in CASES:
        data = make_case(case, ctx.rank, ctx.world, ctx.seed)
        runs = {}
        for name, loss_fn in losses.items():
            runs[name] = call_bapo(ctx, loss_fn, data, dist.group.WORLD)
        out[case] = {"data": case_to_lists(data), "runs": runs}
    return out


def verl_micro_batch(ctx, data, case):
    """(model_output, data) as verl 0.8's engine hands them to the loss for one micro-batch.

    Left-padded prompts and right-padded responses, laid out by Trinity's own
    ``left_right_2_no_padding``; the model's log-probs flat over the attended tokens, shifted by
    one as the engine rolls them (response token k's log-prob sits at prompt_len + k - 1).
    """
    from scripts.harness.engine import trinity_layout

    gen = torch.Generator().manual_seed(_case_seed(ctx.seed, case, ctx.rank) + 7)
    rows, width = data["mask"].shape
    prompt_len = torch.randint(1, PROMPT_WIDTH + 1, (rows,), generator=gen)
    prompt_mask = (torch.arange(PROMPT_WIDTH) >= PROMPT_WIDTH - prompt_len[:, None]).long()
    inside = (torch.arange(width) < data["response_len"][:, None]).long()
    ids = torch.randint(1, 100, (rows, PROMPT_WIDTH + width), generator=gen)
    prompts, responses = ids[:, :PROMPT_WIDTH] * prompt_mask, ids[:, PROMPT_WIDTH:] * inside
    batch = trinity_layout(
        prompts, prompt_mask, responses, inside, data["old_logprob"], data["advantages"]
    )
    batch["response_mask"] = data["mask"]  # some tokens inside a response are masked out
    offsets = batch["input_ids"].offsets()
    flat = torch.full((int(offsets[-1]),), -0.5)  # prompt positions: never read by the loss
    for i in range(rows):
        end, length = int(offsets[i + 1]), int(data["response_len"][i])
        flat[end - length - 1 : end - 1] = data["logprob"][i, :length]
    log_probs = torch.nested.nested_tensor_from_jagged(flat, offsets=offsets)
    return {"log_probs": log_probs.to(ctx.device)}, batch.to(ctx.device)


def algorithm_config(name):
    """The fields of Trinity's AlgorithmConfig that TrinityPolicyLoss reads."""
    from types import SimpleNamespace

    kwargs = loss_kwargs(name)
    return SimpleNamespace(
        policy_loss_fn="bapo",
        policy_loss_fn_args=kwargs,
        kl_loss_fn="none",
        kl_loss_fn_args={},
        entropy_loss_fn="none",
        entropy_loss_fn_args={"entropy_coef": 0.0},
        loss_agg_mode=kwargs.get("loss_agg_mode", "token-mean"),
    )


def check_trinity(ctx):
    """Every case x config through TrinityPolicyLoss with the engine's (model_output, data)."""
    from trinity.trainer.verl.losses import TrinityPolicyLoss

    losses = {name: TrinityPolicyLoss(algorithm_config(name)) for name in CONFIGS}
    out = {}
    for case in CASES:
        data = make_case(case, ctx.rank, ctx.world, ctx.seed)
        model_output, batch = verl_micro_batch(ctx, data, case)
        runs = {}
        for name, loss_fn in losses.items():
            runs[name] = run_record(
                *counted_call(
                    loss_fn, model_output=model_output, data=batch, dp_group=dist.group.WORLD
                )
            )
        out[case] = {"data": case_to_lists(data), "runs": runs}
    return out


def check_subgroup(ctx):
    """Group {0, 1} of a larger job, and a size-1 group {0}; other ranks never call the loss.

    ``new_group`` is collective over WORLD, so every rank creates both groups. The closing
    WORLD barrier (outside the counted region) shows that nobody was left waiting.
    """
    pair_group = dist.new_group([0, 1])
    solo_group = dist.new_group([0])
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    out = {"data": case_to_lists(data), "pair": {}, "solo": {}}
    if ctx.rank in (0, 1):
        for name in CONFIGS:
            loss_fn = BAPOPolicyLossFn(**loss_kwargs(name))
            out["pair"][name] = call_bapo(ctx, loss_fn, data, pair_group)
    if ctx.rank == 0:
        for name in CONFIGS:
            loss_fn = BAPOPolicyLossFn(**loss_kwargs(name))
            out["solo"][name] = call_bapo(ctx, loss_fn, data, solo_group)
    dist.barrier()
    out["passed_barrier"] = True
    return out


def check_sync_off(ctx):
    """sync_across_dp=False with dp_group=WORLD on the 'signs' case: every rank on its own."""
    data = make_case("signs", ctx.rank, ctx.world, ctx.seed)
    runs = {}
    for name in CONFIGS:
        loss_fn = BAPOPolicyLossFn(**loss_kwargs(name, sync_across_dp=False))
        runs[name] = call_bapo(ctx, loss_fn, data, dist.group.WORLD)
    return {"data": case_to_lists(data), "runs": runs}


# One setting changed on the last rank; "same" is the control where nothing differs.
MISMATCHES = {
    "same": {},
    "target": {"positive_contribution_target": 0.45},
    "search_order": {"search_order": "lower_first"},
    "contribution": {"contribution": "gradient"},
    "clip_ratio_c": {"clip_ratio_c": 2.0},
    "grid_same_length": {"ratio_upper_start": 1.25, "ratio_upper_max": 3.05},
    "grid_other_length": {"ratio_upper_max": 2.0},
}


def _outcome(call):
    """The call's metrics, or the type and message of what it raised."""
    try:
        return {"result": call()}
    except Exception as error:  # recorded for the driver, which decides what was expected
        return {"raised": type(error).__name__, "message": str(error)}


def check_mismatch(ctx):
    """Ranks configured differently meet in the one all-reduce; each variant is one call."""
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    out = {}
    for variant, change in MISMATCHES.items():
        kwargs = loss_kwargs("paper_upper_surrogate")
        if ctx.rank == ctx.world - 1:
            kwargs.update(change)
        loss_fn = BAPOPolicyLossFn(**kwargs)
        out[variant] = _outcome(lambda: call_bapo(ctx, loss_fn, data, dist.group.WORLD))
    dist.barrier()
    return out


def check_nonmember(ctx):
    """Rank 2 passes the group {0, 1}, which it does not belong to; 0 and 1 use it rightly."""
    pair_group = dist.new_group([0, 1])
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**loss_kwargs("paper_upper_surrogate"))
    out = _outcome(lambda: call_bapo(ctx, loss_fn, data, pair_group))
    dist.barrier()
    return out


FAILING_CALL = 1  # of three calls on one loss; the last rank passes a bad shape in this one


def check_failure(ctx):
    """The last rank's inputs fail BAPO's checks in the middle call of three.

    Every rank records what each call returned or raised; the third call, where every rank's
    inputs are good again, shows that nobody's collectives were left out of step.
    """
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**loss_kwargs("paper_upper_surrogate"))
    calls = []
    for call in range(3):
        case = data
        if call == FAILING_CALL and ctx.rank == ctx.world - 1:
            case = {**data, "advantages": data["advantages"][:, :-1]}  # one column short
        calls.append(_outcome(lambda: call_bapo(ctx, loss_fn, case, dist.group.WORLD)))
    dist.barrier()
    return {"data": case_to_lists(data), "calls": calls}


NAN_UNMASKED = 2  # NaN log-probs placed on unmasked tokens of the last rank


def check_nonfinite(ctx):
    """Put NaN log-probs on the last rank only (two unmasked, one masked); others finite."""
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    if ctx.rank == ctx.world - 1:
        logprob, mask = data["logprob"].clone(), data["mask"].clone()
        logprob[0, 0] = logprob[0, 1] = float("nan")
        mask[0, 0] = mask[0, 1] = 1
        logprob[0, 2] = float("nan")
        mask[0, 2] = 0
        data = {**data, "logprob": logprob, "mask": mask}
    runs = {}
    for name in CONFIGS:
        loss_fn = BAPOPolicyLossFn(**loss_kwargs(name))
        runs[name] = call_bapo(ctx, loss_fn, data, dist.group.WORLD)
    return {"runs": runs, "expected_nonfinite": NAN_UNMASKED}


GRADIENT_CONFIGS = ("paper_upper_surrogate", "paper_lower_gradient")


def check_gradient(ctx):
    """Tiny bigram policy; per-rank gradients averaged by an explicit all_reduce / world.

    The same data runs with sync on and off; the driver compares both averages with the
    single-process gradient on the union.
    """
    batch = make_policy_batch(ctx.rank, ctx.seed)
    start = tiny_policy_params(ctx.seed)
    out = {
        "params": {k: v.tolist() for k, v in start.items()},
        "batch": {k: v.tolist() for k, v in batch.items()},
        "runs": {},
    }
    dev = ctx.put(batch)
    for name in GRADIENT_CONFIGS:
        for sync in (True, False):
            params = {  # a fresh leaf per run: gradients must not pile up across runs
                k: v.detach().clone().to(ctx.device).requires_grad_(True) for k, v in start.items()
            }
            logprob = tiny_policy_logprob(params, dev["prev"], dev["target"])
            old_logprob = logprob.detach() - dev["log_ratio"]
            loss_fn = BAPOPolicyLossFn(**loss_kwargs(name, sync_across_dp=sync))
            loss, metrics, counter = counted_call(
                loss_fn,
                logprob=logprob,
                old_logprob=old_logprob,
                action_mask=dev["mask"],
                advantages=dev["advantages"],
                dp_group=dist.group.WORLD,
            )
            loss.backward()
            grads = {}
            for key, value in params.items():
                grad = value.grad.detach().clone()
                dist.all_reduce(grad, op=dist.ReduceOp.SUM)
                grads[key] = (grad / ctx.world).cpu().tolist()
            runs = out["runs"].setdefault(name, {})
            runs["sync" if sync else "nosync"] = {
                "metrics": _plain(metrics),
                "collectives": counter.ops,
                "grad": grads,
            }
    return out


CHECKS = {
    "group_none": check_group_none,
    "oracle": check_oracle,
    "trinity": check_trinity,
    "subgroup": check_subgroup,
    "sync_off": check_sync_off,
    "nonfinite": check_nonfinite,
    "gradient": check_gradient,
    "mismatch": check_mismatch,
    "nonmember": check_nonmember,
    "failure": check_failure,
}
