"""torchrun worker for tests/test_bapo_distributed.py: BAPO's bound search across ranks.

Launched as ``torchrun --nproc_per_node=N bapo_checks.py --out DIR --checks a,b,...``. Every
rank runs the named checks in order and rewrites ``DIR/rank<R>.json`` after each one, with what
it computed and the data it used; the pytest driver recomputes the single-process answer on the
union of the ranks' data and asserts. This file only records: no expected value lives here.

Collectives are counted with a TorchDispatchMode that sees every ``c10d`` op, whichever Python
path issued it, and only around the loss call. A failing check is recorded with its traceback
and ends the run, since the other ranks may now wait in a collective this rank will never join
(the process-group timeout turns that wait into their own recorded error).
"""

import argparse
import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import bapo_dist_common as common
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

GROUP_TIMEOUT = timedelta(seconds=40)
PROMPT_WIDTH = 4


class CollectiveCounter(TorchDispatchMode):
    """The c10d ops (all_reduce, all_gather, barrier, ...) dispatched while active.

    ``ops`` holds their names; ``values`` the element count each one sends (its first tensor
    argument, or the first tensor of its first list argument).
    """

    def __init__(self):
        """Start with no collective seen."""
        super().__init__()
        self.ops = []
        self.values = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Record c10d ops, then run every op unchanged."""
        if func.namespace == "c10d":
            self.ops.append(str(func))
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.values.append(first.numel() if torch.is_tensor(first) else None)
        return func(*args, **(kwargs or {}))


class Context:
    """This rank's place in the job and its device."""

    def __init__(self, args):
        """Read rank, world size, seed and device from the launch."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.seed, self.backend = args.seed, args.backend
        if args.backend == "nccl":
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        else:
            self.device = torch.device("cpu")

    def put(self, data):
        """Move a case's tensors to this rank's device."""
        return {key: value.to(self.device) for key, value in data.items()}


def _plain(metrics):
    """Metric values as JSON numbers (NaN becomes the string 'nan')."""
    out = {}
    for key, value in metrics.items():
        value = float(value.item() if torch.is_tensor(value) else value)
        out[key] = value if value == value else "nan"
    return out


def counted_call(loss_fn, **kwargs):
    """Call the loss with the collective counter active; return (loss, metrics, counter)."""
    with CollectiveCounter() as counter:
        loss, metrics = loss_fn(**kwargs)
    return loss, metrics, counter


def run_record(loss, metrics, counter):
    """What a driver reads of one call: metrics, loss, collectives and their sizes."""
    return {
        "metrics": _plain(metrics),
        "loss": float(loss),
        "collectives": counter.ops,
        "values": counter.values,
    }


def call_bapo(ctx, loss_fn, data, group):
    """Call BAPO on one case with ``group``; return metrics, loss and collectives."""
    data = ctx.put(data)
    return run_record(
        *counted_call(
            loss_fn,
            logprob=data["logprob"],
            old_logprob=data["old_logprob"],
            action_mask=data["mask"],
            advantages=data["advantages"],
            dp_group=group,
        )
    )


# --------------------------------------------------------------------------- checks


def check_group_none(ctx):
    """Sync on, no group, world > 1: one RuntimeWarning over two calls, and a local choice.

    Runs first in its process, since the warning is emitted once per process.
    """
    data = common.make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**common.loss_kwargs("paper_upper_surrogate"))
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            calls.append(call_bapo(ctx, loss_fn, data, None))
    return {
        "data": common.case_to_lists(data),
        "calls": calls,
        "warnings": [{"category": w.category.__name__, "message": str(w.message)} for w in caught],
    }


def check_oracle(ctx):
    """Every case x config through BAPOPolicyLossFn with dp_group=WORLD.

    One loss per config serves every case, in order, so that the first case's calls are the
    first on the group and the later ones show what each call after it costs.
    """
    losses = {name: BAPOPolicyLossFn(**common.loss_kwargs(name)) for name in common.CONFIGS}
    out = {}
    for case in common.CASES:
        data = common.make_case(case, ctx.rank, ctx.world, ctx.seed)
        runs = {}
        for name, loss_fn in losses.items():
            runs[name] = call_bapo(ctx, loss_fn, data, dist.group.WORLD)
        out[case] = {"data": common.case_to_lists(data), "runs": runs}
    return out


def verl_micro_batch(ctx, data, case):
    """(model_output, data) as verl 0.8's engine hands them to the loss for one micro-batch.

    The padded batch is what Trinity's ``to_data_proto`` builds (left-padded prompts,
    right-padded responses); the no-padding form mirrors ``left_right_2_no_padding`` (which
    needs flash-attn, absent on CPU): jagged ``input_ids`` / ``position_ids`` over the attended
    tokens, and the model's log-probs flat over the same tokens, shifted by one as the engine
    rolls them (the log-prob of response token k sits at position prompt_len + k - 1).
    """
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(common._case_seed(ctx.seed, case, ctx.rank) + 7)
    rows, width = data["mask"].shape
    prompt_len = torch.randint(1, PROMPT_WIDTH + 1, (rows,), generator=gen)
    columns = torch.arange(PROMPT_WIDTH + width)
    attention = (columns >= PROMPT_WIDTH - prompt_len.unsqueeze(1)) & (
        columns < PROMPT_WIDTH + data["response_len"].unsqueeze(1)
    )
    attention = attention.to(torch.int64)
    ids = torch.randint(1, 100, (rows, PROMPT_WIDTH + width), generator=gen) * attention
    positions = torch.clip(attention.cumsum(-1) - 1, 0, None)

    batch = tu.get_tensordict(
        tensor_dict={
            "prompts": ids[:, :PROMPT_WIDTH],
            "responses": ids[:, PROMPT_WIDTH:],
            "attention_mask": attention,
            "response_mask": data["mask"],
            "old_log_probs": data["old_logprob"],
            "advantages": data["advantages"],
        },
        non_tensor_dict={},
    )
    keep = attention.bool()
    batch["input_ids"] = torch.nested.as_nested_tensor(
        [ids[i][keep[i]] for i in range(rows)], layout=torch.jagged
    )
    batch["position_ids"] = torch.nested.as_nested_tensor(
        [positions[i][keep[i]] for i in range(rows)], layout=torch.jagged
    )
    batch["loss_mask"] = batch["response_mask"]
    tu.assign_non_tensor_data(batch, "max_seq_len", PROMPT_WIDTH + width)
    tu.assign_non_tensor_data(batch, "max_response_len", width)

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

    kwargs = common.loss_kwargs(name)
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

    losses = {name: TrinityPolicyLoss(algorithm_config(name)) for name in common.CONFIGS}
    out = {}
    for case in common.CASES:
        data = common.make_case(case, ctx.rank, ctx.world, ctx.seed)
        model_output, batch = verl_micro_batch(ctx, data, case)
        runs = {}
        for name, loss_fn in losses.items():
            runs[name] = run_record(
                *counted_call(
                    loss_fn, model_output=model_output, data=batch, dp_group=dist.group.WORLD
                )
            )
        out[case] = {"data": common.case_to_lists(data), "runs": runs}
    return out


def check_subgroup(ctx):
    """Group {0, 1} of a larger job, and a size-1 group {0}; other ranks never call the loss.

    ``new_group`` is collective over WORLD, so every rank creates both groups. The closing
    WORLD barrier (outside the counted region) shows that nobody was left waiting.
    """
    pair_group = dist.new_group([0, 1])
    solo_group = dist.new_group([0])
    data = common.make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    out = {"data": common.case_to_lists(data), "pair": {}, "solo": {}}
    if ctx.rank in (0, 1):
        for name in common.CONFIGS:
            loss_fn = BAPOPolicyLossFn(**common.loss_kwargs(name))
            out["pair"][name] = call_bapo(ctx, loss_fn, data, pair_group)
    if ctx.rank == 0:
        for name in common.CONFIGS:
            loss_fn = BAPOPolicyLossFn(**common.loss_kwargs(name))
            out["solo"][name] = call_bapo(ctx, loss_fn, data, solo_group)
    dist.barrier()
    out["passed_barrier"] = True
    return out


def check_sync_off(ctx):
    """sync_across_dp=False with dp_group=WORLD on the 'signs' case: every rank on its own."""
    data = common.make_case("signs", ctx.rank, ctx.world, ctx.seed)
    runs = {}
    for name in common.CONFIGS:
        loss_fn = BAPOPolicyLossFn(**common.loss_kwargs(name, sync_across_dp=False))
        runs[name] = call_bapo(ctx, loss_fn, data, dist.group.WORLD)
    return {"data": common.case_to_lists(data), "runs": runs}


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
    data = common.make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    out = {}
    for variant, change in MISMATCHES.items():
        kwargs = common.loss_kwargs("paper_upper_surrogate")
        if ctx.rank == ctx.world - 1:
            kwargs.update(change)
        loss_fn = BAPOPolicyLossFn(**kwargs)
        out[variant] = _outcome(lambda: call_bapo(ctx, loss_fn, data, dist.group.WORLD))
    dist.barrier()
    return out


def check_nonmember(ctx):
    """Rank 2 passes the group {0, 1}, which it does not belong to; 0 and 1 use it rightly."""
    pair_group = dist.new_group([0, 1])
    data = common.make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**common.loss_kwargs("paper_upper_surrogate"))
    out = _outcome(lambda: call_bapo(ctx, loss_fn, data, pair_group))
    dist.barrier()
    return out


FAILING_CALL = 1  # of three calls on one loss; the last rank passes a bad shape in this one


def check_failure(ctx):
    """The last rank's inputs fail BAPO's checks in the middle call of three.

    Every rank records what each call returned or raised; the third call, where every rank's
    inputs are good again, shows that nobody's collectives were left out of step.
    """
    data = common.make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**common.loss_kwargs("paper_upper_surrogate"))
    calls = []
    for call in range(3):
        case = data
        if call == FAILING_CALL and ctx.rank == ctx.world - 1:
            case = {**data, "advantages": data["advantages"][:, :-1]}  # one column short
        calls.append(_outcome(lambda: call_bapo(ctx, loss_fn, case, dist.group.WORLD)))
    dist.barrier()
    return {"data": common.case_to_lists(data), "calls": calls}


NAN_UNMASKED = 2  # NaN log-probs placed on unmasked tokens of the last rank


def check_nonfinite(ctx):
    """Put NaN log-probs on the last rank only (two unmasked, one masked); others finite."""
    data = common.make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    if ctx.rank == ctx.world - 1:
        logprob, mask = data["logprob"].clone(), data["mask"].clone()
        logprob[0, 0] = logprob[0, 1] = float("nan")
        mask[0, 0] = mask[0, 1] = 1
        logprob[0, 2] = float("nan")
        mask[0, 2] = 0
        data = {**data, "logprob": logprob, "mask": mask}
    runs = {}
    for name in common.CONFIGS:
        loss_fn = BAPOPolicyLossFn(**common.loss_kwargs(name))
        runs[name] = call_bapo(ctx, loss_fn, data, dist.group.WORLD)
    return {"runs": runs, "expected_nonfinite": NAN_UNMASKED}


GRADIENT_CONFIGS = ("paper_upper_surrogate", "paper_lower_gradient")


def check_gradient(ctx):
    """Tiny bigram policy; per-rank gradients averaged by an explicit all_reduce / world.

    The same data runs with sync on and off; the driver compares both averages with the
    single-process gradient on the union.
    """
    batch = common.make_policy_batch(ctx.rank, ctx.seed)
    start = common.tiny_policy_params(ctx.seed)
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
            logprob = common.tiny_policy_logprob(params, dev["prev"], dev["target"])
            old_logprob = logprob.detach() - dev["log_ratio"]
            loss_fn = BAPOPolicyLossFn(**common.loss_kwargs(name, sync_across_dp=sync))
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


def write_record(path, record):
    """Replace the rank's file in one step, so a killed run never leaves half a JSON."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)


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


def main():
    """Run the named checks in order, writing this rank's JSON after each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--checks", required=True, help=f"comma list of {sorted(CHECKS)}")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = [n for n in args.checks.split(",") if n]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}")

    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(args.backend, timeout=GROUP_TIMEOUT)
    ctx = Context(args)
    path = args.out / f"rank{ctx.rank}.json"
    record = {"rank": ctx.rank, "world": ctx.world, "backend": args.backend, "checks": {}}
    for name in names:
        try:
            record["checks"][name] = CHECKS[name](ctx)
        except Exception:
            record["checks"][name] = {"error": traceback.format_exc()}
            write_record(path, record)
            print(f"rank {ctx.rank}: check {name} failed", file=sys.stderr, flush=True)
            traceback.print_exc()
            os._exit(1)  # no clean shutdown: peers may be waiting in a collective
        write_record(path, record)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
