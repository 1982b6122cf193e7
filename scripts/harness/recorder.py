"""The one loss recorder: each call goes to the real loss unchanged, and is noted."""

import json
from pathlib import Path
from typing import Optional

import torch.distributed as dist


class LossRecorder:
    """Records each policy-loss call, in the place of a ``TrinityPolicyLoss``'s policy loss."""

    def __init__(
        self, trinity_loss, engine_group=None, keep_inputs=False, log_dir: Optional[Path] = None
    ):
        """Take the place of ``trinity_loss.policy_loss_fn``; ``engine_group`` is the expected.

        ``log_dir``: each call is also appended to ``rank<N>.jsonl`` there (N: the global rank),
        for ranks whose recorder the caller cannot reach (a Ray actor's).
        """
        self._inner, self.engine_group = trinity_loss.policy_loss_fn, engine_group
        self.keep_inputs, self.log_dir = keep_inputs, log_dir
        self.calls, self.pass_calls = list[dict](), list[dict]()
        trinity_loss.policy_loss_fn = self

    def __getattr__(self, name):
        """Everything else is the real loss's."""
        return getattr(self._inner, name)

    def __call__(self, logprob, dp_group=None, **kwargs):
        """Run the real loss, then note its group, metrics and (if kept) inputs.

        A call that returns no metrics, one of the pass over an update's data that a loss with
        ``optimizer_update`` runs, is noted in ``pass_calls``.
        """
        loss, metrics = self._inner(logprob=logprob, dp_group=dp_group, **kwargs)
        ranks = None if dp_group is None else dist.get_process_group_ranks(dp_group)
        call = {"group_ranks": ranks, "is_engine_group": dp_group is self.engine_group}
        call["metrics"] = {key: float(value) for key, value in metrics.items()}
        call["update_pass"] = not metrics
        if self.log_dir is not None:
            with open(self.log_dir / f"rank{dist.get_rank()}.jsonl", "a") as log:
                log.write(json.dumps(call) + "\n")
        if self.keep_inputs:
            inputs = dict(logprob=logprob.detach().clone(), old_logprob=kwargs["old_log_probs"])
            inputs.update(advantages=kwargs["advantages"], mask=kwargs["response_mask"].long())
            call["inputs"] = inputs
        (self.pass_calls if call["update_pass"] else self.calls).append(call)
        return loss, metrics
