"""The launched checks' runner: named checks on every rank of a torchrun job, JSON per rank.

A check module ends with ``sys.exit(main(CHECKS))`` and is launched as ``python -m tests.<module>
--out DIR --checks a,b [--option k=v]`` through ``scripts.harness.launch.torchrun``. Each rank
rewrites ``DIR/rank<R>.json`` after every check; a check that raises ends the job at once.
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

from scripts.harness.dp_worker import CollectiveCounter


def write_record(path: Path, record: dict) -> None:
    """Replace a rank's file in one step, so a killed run never leaves half a JSON."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, default=str))
    os.replace(partial, path)


def rank_records(out: Path, nproc: int) -> list:
    """Each rank's JSON record from ``out``, None where a rank wrote none."""
    paths = [out / f"rank{rank}.json" for rank in range(nproc)]
    return [json.loads(p.read_text()) if p.exists() else None for p in paths]


class Context:
    """This rank's place in the job, the launch's options and the device of its backend."""

    def __init__(self, args):
        """Read rank and world size from the process group, options from the command line."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.options = dict(option.split("=", 1) for option in args.option)
        cuda = args.backend == "nccl"
        self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else "cpu"

    def put(self, data: dict) -> dict:
        """Move a case's tensors to this rank's device (a meta tensor, or no tensor, stays)."""
        moves = {k: isinstance(v, torch.Tensor) and not v.is_meta for k, v in data.items()}
        return {k: v.to(self.device) if moves[k] else v for k, v in data.items()}


def call_bapo(ctx: Context, loss_fn, data: dict, group) -> dict:
    """Call the loss on one case under a collective counter; return what a driver reads."""
    data = ctx.put(data)
    with CollectiveCounter() as counter:
        loss, metrics = loss_fn(
            logprob=data["logprob"],
            old_logprob=data["old_logprob"],
            action_mask=data["mask"],
            advantages=data["advantages"],
            dp_group=group,
        )
    plain = {k: float(v) for k, v in metrics.items()}
    return {
        "metrics": {k: v if v == v else "nan" for k, v in plain.items()},  # NaN is not JSON
        "loss": float(loss),
        "collectives": counter.ops,
    }


def outcome(call) -> dict:
    """The call's result, or the type and message of what it raised."""
    try:
        return {"result": call()}
    except Exception as error:  # recorded for the driver, which decides what was expected
        return {"raised": type(error).__name__, "message": str(error)}


def main(checks: dict, argv=None) -> int:
    """Start the process group, run the named ``checks`` in order, shut down."""
    parser = argparse.ArgumentParser(description="Run named checks on every rank.")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--checks", required=True, help="comma list of check names")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for the checks")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--group-timeout", type=float, default=40.0, help="seconds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.group_timeout))
    ctx = Context(args)
    path = args.out / f"rank{ctx.rank}.json"
    record: dict = {"rank": ctx.rank, "world": ctx.world, "checks": {}}
    for name in args.checks.split(","):
        try:
            record["checks"][name] = checks[name](ctx)
        except Exception:
            record["checks"][name] = {"error": traceback.format_exc()}
            write_record(path, record)
            print(f"rank {ctx.rank}: check {name} failed", file=sys.stderr, flush=True)
            traceback.print_exc()
            os._exit(1)  # no clean shutdown: peers may be waiting in a collective
        write_record(path, record)
    dist.barrier()
    dist.destroy_process_group()
    return 0
