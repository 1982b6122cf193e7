"""The one loss recorder, put where ``TrinityPolicyLoss`` keeps its policy loss.

Each call goes to the real loss unchanged; the recorder notes the group, the metrics and, if
asked, the inputs (for a driver's oracle). Every other attribute is the real loss's.
"""

from typing import Dict, List

import torch

from scripts.harness.engine import group_ranks


class LossRecorder:
    """Records each policy-loss call; ``install`` puts one into a ``TrinityPolicyLoss``."""

    def __init__(self, inner, engine_group=None, keep_inputs: bool = False):
        """Wrap ``inner``; ``engine_group`` is what a call should receive."""
        self._inner, self.engine_group, self.keep_inputs = inner, engine_group, keep_inputs
        self.calls: List[Dict] = []

    @classmethod
    def install(cls, trinity_loss, engine_group=None, keep_inputs: bool = False) -> "LossRecorder":
        """Replace ``trinity_loss.policy_loss_fn`` by a recorder around it; return the recorder."""
        recorder = cls(trinity_loss.policy_loss_fn, engine_group, keep_inputs)
        trinity_loss.policy_loss_fn = recorder
        return recorder

    def __getattr__(self, name):
        """Everything else is the real loss's."""
        return getattr(self._inner, name)

    @property
    def forwarded(self) -> bool:
        """Whether every call so far received the engine's group."""
        return all(call["is_engine_group"] for call in self.calls)

    def __call__(self, logprob, dp_group=None, **kwargs):
        """Run the real loss, then note its group, metrics and (if kept) inputs."""
        loss, metrics = self._inner(logprob=logprob, dp_group=dp_group, **kwargs)
        call = {
            "group_ranks": group_ranks(dp_group),
            "is_engine_group": dp_group is self.engine_group,
            "metrics": {key: float(value) for key, value in metrics.items()},
        }
        if self.keep_inputs:
            call["inputs"] = {
                "logprob": logprob.detach().clone(),
                "old_logprob": kwargs["old_log_probs"],
                "advantages": kwargs["advantages"],
                "mask": kwargs["response_mask"].to(torch.int64),
            }
        self.calls.append(call)
        return loss, metrics
