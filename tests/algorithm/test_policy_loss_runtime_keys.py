# -*- coding: utf-8 -*-
"""Test runtime keys: what the trainer passes a policy loss beside the batch (e.g. dp_group)."""

import unittest

import torch
from tensordict import TensorDict

from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn
from trinity.common.config import AlgorithmConfig
from trinity.trainer.verl.losses import TrinityPolicyLoss


class RecordingLoss(PolicyLossFn):
    """A policy loss that declares `dp_group` and records the keyword arguments it gets."""

    _runtime_keys = {"dp_group"}

    def __call__(self, logprob, old_logprob, action_mask, advantages, dp_group=None, **kwargs):
        """Record what was passed; return a loss that depends on it."""
        self.received = {"dp_group": dp_group, **kwargs}
        return (logprob * advantages * action_mask).sum(), {}

    @classmethod
    def default_args(cls):
        """No arguments."""
        return {}


class SubclassedLoss(RecordingLoss):
    """Overrides `__call__` and declares nothing itself: it inherits the runtime key."""

    def __call__(self, logprob, old_logprob, action_mask, advantages, dp_group=None):
        """Pass everything on to the base class."""
        return super().__call__(logprob, old_logprob, action_mask, advantages, dp_group)


class PlainLoss(PolicyLossFn):
    """A policy loss that declares no runtime key, as every loss before this change."""

    def __call__(self, logprob, old_logprob, action_mask, advantages, **kwargs):
        """Record the keyword arguments besides the batch fields."""
        self.received = dict(kwargs)
        return (logprob * advantages * action_mask).sum(), {}

    @classmethod
    def default_args(cls):
        """No arguments."""
        return {}


def call_engine_loss(policy_loss_fn, dp_group):
    """Call TrinityPolicyLoss as verl's engine does (two rows of 3 response tokens, no padding).

    With a KL loss, whose `ref_log_prob` TrinityPolicyLoss hands the policy loss too.
    """
    config = AlgorithmConfig(
        policy_loss_fn="ppo",
        policy_loss_fn_args={"clip_range": 0.2},
        kl_loss_fn="k2",
        kl_loss_fn_args={"kl_coef": 0.001},
        entropy_loss_fn="none",
        entropy_loss_fn_args={"entropy_coef": 0.0},
        loss_agg_mode="token-mean",
    )
    loss = TrinityPolicyLoss(config)
    loss.policy_loss_fn = policy_loss_fn
    data = TensorDict(
        {
            "prompts": torch.ones(2, 1, dtype=torch.long),
            "responses": torch.ones(2, 3, dtype=torch.long),
            "attention_mask": torch.ones(2, 4, dtype=torch.long),
            "response_mask": torch.ones(2, 3, dtype=torch.long),
            "old_log_probs": torch.zeros(2, 3),
            "advantages": torch.ones(2, 3),
            "ref_log_prob": torch.zeros(2, 3),
        },
        batch_size=[2],
    )
    return loss({"log_probs": torch.zeros(8)}, data, dp_group=dp_group)


class PolicyLossRuntimeKeysTest(unittest.TestCase):
    """Runtime keys bypass the batch and reach only the losses that declare them."""

    def test_runtime_keys_are_not_batch_fields(self):
        """A runtime key stays out of select_keys, for the class and a subclass alike."""
        expected = ["old_log_probs", "response_mask", "advantages"]
        self.assertEqual(RecordingLoss().select_keys, expected)
        self.assertEqual(SubclassedLoss().select_keys, expected)
        self.assertEqual(SubclassedLoss._runtime_keys, {"dp_group"})

    def test_engine_loss_forwards_the_group_to_a_loss_that_declares_it(self):
        """The very object verl's engine passes reaches the loss, and a subclass of it."""
        group = object()  # TrinityPolicyLoss hands it on without reading it
        for loss_fn in (RecordingLoss(), SubclassedLoss()):
            call_engine_loss(loss_fn, group)
            self.assertIs(loss_fn.received["dp_group"], group)

    def test_a_loss_that_declares_nothing_sees_what_it_saw_before(self):
        """No runtime key: no extra keyword argument (not `ref_log_prob`), the same batch fields."""
        loss_fn = PlainLoss()
        call_engine_loss(loss_fn, object())
        self.assertEqual(loss_fn.received, {})
        self.assertEqual(loss_fn.select_keys, ["old_log_probs", "response_mask", "advantages"])


if __name__ == "__main__":
    unittest.main()
