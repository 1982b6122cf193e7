# -*- coding: utf-8 -*-
"""Test that algorithm.loss_agg_mode and the policy loss's loss_agg_mode always agree.

The trainer aggregates the KL and entropy terms with ``algorithm.loss_agg_mode`` and the policy
loss uses its own ``loss_agg_mode`` argument; the algorithm validator must make them one value
whichever of the two places the user wrote it in, and whatever other loss arguments are set.
"""

import unittest

from trinity.common.config import Config
from trinity.common.config_validator import AlgorithmConfigValidator


def validated(algorithm_type: str, loss_args=None, loss_agg_mode=None, loss=None) -> Config:
    """Run the algorithm validator on a config with only these algorithm fields written."""
    config = Config()
    config.algorithm.algorithm_type = algorithm_type
    config.algorithm.policy_loss_fn = loss
    config.algorithm.policy_loss_fn_args = loss_args
    config.algorithm.loss_agg_mode = loss_agg_mode
    AlgorithmConfigValidator().validate(config)
    return config


class LossAggModeConfigTest(unittest.TestCase):
    """Where loss_agg_mode is written, and what the policy loss and the trainer end up with."""

    def test_algorithm_mode_reaches_partial_loss_args(self):
        """A mode at algorithm level reaches a loss whose written args leave it out."""
        config = validated("ppo", {"clip_range": 0.3}, "seq-mean-token-mean")
        self.assertEqual(
            config.algorithm.policy_loss_fn_args,
            {"clip_range": 0.3, "loss_agg_mode": "seq-mean-token-mean"},
        )

    def test_algorithm_mode_reaches_default_loss_args(self):
        """With no loss args written, the defaults take the algorithm's mode."""
        config = validated("grpo", None, "seq-mean-token-sum")
        self.assertEqual(
            config.algorithm.policy_loss_fn_args["loss_agg_mode"], "seq-mean-token-sum"
        )
        self.assertEqual(config.algorithm.policy_loss_fn_args["clip_range"], 0.2)

    def test_mode_in_loss_args_only_is_the_algorithms(self):
        """A mode written only in the loss args is the trainer's mode too."""
        config = validated("grpo", {"loss_agg_mode": "seq-mean-token-sum-norm"})
        self.assertEqual(config.algorithm.loss_agg_mode, "seq-mean-token-sum-norm")
        self.assertEqual(
            config.algorithm.policy_loss_fn_args["loss_agg_mode"], "seq-mean-token-sum-norm"
        )

    def test_algorithm_mode_wins_when_both_are_written(self):
        """Written in both places, the algorithm's value is the one both use."""
        config = validated("grpo", {"loss_agg_mode": "token-mean"}, "seq-mean-token-mean")
        self.assertEqual(config.algorithm.loss_agg_mode, "seq-mean-token-mean")
        self.assertEqual(
            config.algorithm.policy_loss_fn_args["loss_agg_mode"], "seq-mean-token-mean"
        )

    def test_loss_without_the_argument_is_left_alone(self):
        """A loss that takes no loss_agg_mode (DPO's) does not get one."""
        config = validated("grpo", {"beta": 0.2}, "seq-mean-token-mean", loss="dpo")
        self.assertEqual(config.algorithm.policy_loss_fn_args, {"beta": 0.2})


if __name__ == "__main__":
    unittest.main()
