"""By-hand check that BAPO's synchronised bound search gives every data-parallel rank one pair.

Run under torchrun, for example:

    torchrun --nproc_per_node=4 scripts/bapo_dp_check.py --calls 5
    torchrun --nproc_per_node=4 scripts/bapo_dp_check.py --no-sync        # see them differ
    torchrun --nproc_per_node=4 scripts/bapo_dp_check.py --group 0,1      # a sub-group

Each rank draws a batch of its own on every call (its own size, sign mix and ratio spread),
calls BAPOPolicyLossFn with dp_group = WORLD (or the --group sub-group; ranks outside it do not
call the loss), and the chosen pairs are gathered over WORLD. Rank 0 prints, per call, the pair
of every rank and whether the group's ranks agree. The exit code is 1 if they disagree while
sync is on, else 0 (with --no-sync, disagreement is expected and only reported).
"""

import argparse
import sys


def parse_args(argv=None):
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Launch with torchrun; a plain python run acts as a single rank.",
    )
    parser.add_argument("--calls", type=int, default=3, help="loss calls per rank (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="base seed of the random batches")
    parser.add_argument(
        "--no-sync", action="store_true", help="sync_across_dp=False: each rank on its own"
    )
    parser.add_argument(
        "--group", default=None, help="comma list of ranks forming the dp group (default WORLD)"
    )
    parser.add_argument(
        "--search-order", default="upper_first", choices=("upper_first", "lower_first")
    )
    parser.add_argument("--contribution", default="surrogate", choices=("surrogate", "gradient"))
    parser.add_argument(
        "--backend",
        default=None,
        choices=("gloo", "nccl"),
        help="default: nccl when every rank has a GPU, else gloo",
    )
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    return args


def random_batch(torch, seed, rank, call, device):
    """A batch whose size, sign mix and ratio spread depend on (seed, rank, call)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + call)
    rows = int(torch.randint(2, 7, (), generator=gen))
    width = int(torch.randint(8, 41, (), generator=gen))
    positive_share = float(torch.rand((), generator=gen)) * 0.9 + 0.05
    spread = float(torch.rand((), generator=gen)) * 0.6 + 0.2
    shift = (float(torch.rand((), generator=gen)) - 0.5) * 0.4
    old = -(torch.rand(rows, width, generator=gen) * 3.0 + 0.05)
    logprob = old + shift + spread * torch.randn(rows, width, generator=gen)
    sign = torch.where(torch.rand(rows, width, generator=gen) < positive_share, 1.0, -1.0)
    advantages = sign * (torch.randn(rows, width, generator=gen).abs() + 0.05)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64)
    batch = dict(logprob=logprob, old_logprob=old, action_mask=mask, advantages=advantages)
    return {key: value.to(device) for key, value in batch.items()}


def main(argv=None) -> int:
    """Run the calls, print each rank's pair, exit 1 if synced ranks disagree."""
    args = parse_args(argv)
    import os

    import torch
    import torch.distributed as dist

    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "RANK" not in os.environ:  # plain python: a one-rank job
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    backend = args.backend
    if backend is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend = "nccl" if gpus >= local_world else "gloo"
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    members = list(range(world))
    group = dist.group.WORLD
    if args.group is not None:
        members = sorted({int(r) for r in args.group.split(",")})
        if not members or members[0] < 0 or members[-1] >= world:
            raise SystemExit(f"--group {args.group}: ranks must lie in 0..{world - 1}")
        group = dist.new_group(members)  # collective over WORLD: every rank creates it

    loss_fn = BAPOPolicyLossFn(
        search_order=args.search_order,
        contribution=args.contribution,
        sync_across_dp=not args.no_sync,
    )
    disagreements = 0
    if rank == 0:
        mode = "sync off" if args.no_sync else "sync on"
        print(
            f"BAPO dp check: {world} ranks, group {members}, {backend}, {mode}, "
            f"{args.search_order}/{args.contribution}",
            flush=True,
        )
    for call in range(args.calls):
        row = torch.full((4,), float("nan"), dtype=torch.float64, device=device)
        if rank in members:
            batch = random_batch(torch, args.seed, rank, call, device)
            _, metrics = loss_fn(**batch, dp_group=group)
            tokens = float(batch["action_mask"].sum())
            row = torch.tensor(
                [
                    metrics["bapo_clip_low"],
                    metrics["bapo_clip_high"],
                    metrics["bapo_positive_contribution"],
                    tokens,
                ],
                dtype=torch.float64,
                device=device,
            )
        gathered = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(gathered, row)
        rows = [r.tolist() for r in gathered]
        pairs = {r: (rows[r][0], rows[r][1]) for r in members}
        agree = len(set(pairs.values())) == 1
        disagreements += not agree
        if rank == 0:
            cells = "  ".join(
                (
                    f"rank{r} ({rows[r][0]:.2f}, {rows[r][1]:.2f}) rho={rows[r][2]:.3f} "
                    f"n={int(rows[r][3])}"
                    if r in members
                    else f"rank{r} (not in group)"
                )
                for r in range(world)
            )
            print(f"call {call}: {cells}  agree: {'yes' if agree else 'NO'}", flush=True)
    if rank == 0:
        verdict = "all calls agree" if not disagreements else f"{disagreements} call(s) disagree"
        print(verdict + (" (expected without sync)" if args.no_sync and disagreements else ""))
    dist.destroy_process_group()
    return 1 if disagreements and not args.no_sync else 0


if __name__ == "__main__":
    sys.exit(main())
