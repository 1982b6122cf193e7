# -*- coding: utf-8 -*-
"""Test that the algorithm validator settles the policy loss's arguments and builds the loss.

A loss_agg_mode written at the algorithm level or only among the loss arguments is the one both
the policy loss and the trainer use, and two different ones are refused; an unwritten one stays
as trinity-rft 0.6.0 left it. Every registered policy loss is then built from those arguments,
with the backend of the trainer that will train it: an unknown key, or a value its constructor
refuses, fails at validation with a ValueError naming it.
"""

import unittest
from unittest import mock

import yaml

from trinity.algorithm import POLICY_LOSS_FN
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn
from trinity.common.config import Config, ExperienceBufferConfig
from trinity.common.config_validator import AlgorithmConfigValidator

MODE = "seq-mean-token-sum"  # no preset or loss defaults to it
LOSSES = sorted(set(POLICY_LOSS_FN._default_mapping) | set(POLICY_LOSS_FN.modules))


def validated(preset="grpo", loss_agg_mode=None, loss_args=None, policy_loss_fn=None, **trainer):
    """Run the algorithm validator on a config with only these algorithm fields written.

    ``trainer``: ``tinker`` (``model.tinker.enable``) or ``trainer_type``, the trainer's choice.
    The fields pass through YAML, so their strings are read at run time as a config file's are,
    not the literals the validator compares them with.
    """
    fields = [preset, loss_agg_mode, loss_args, policy_loss_fn, trainer]
    preset, loss_agg_mode, loss_args, policy_loss_fn, trainer = yaml.safe_load(
        yaml.safe_dump(fields)
    )
    config = Config()
    config.model.tinker.enable = trainer.get("tinker", False)
    config.trainer.trainer_type = trainer.get("trainer_type", "verl")
    config.mode = "train"  # SFT and DPO validate only in train mode, with an experience buffer
    config.buffer.trainer_input.experience_buffer = ExperienceBufferConfig(
        name="experience", path="experience.jsonl"
    )
    config.algorithm.algorithm_type = preset
    config.algorithm.policy_loss_fn = policy_loss_fn
    config.algorithm.loss_agg_mode = loss_agg_mode
    config.algorithm.policy_loss_fn_args = loss_args
    AlgorithmConfigValidator().validate(config)
    return config


class PolicyLossArgsConfigTest(unittest.TestCase):
    """The mode's three places, and arguments the loss refuses."""

    def test_a_mode_written_at_algorithm_level_reaches_the_loss(self):
        """Beside loss arguments that leave it out; not to a loss that takes none (DPO's)."""
        config = validated(loss_agg_mode=MODE, loss_args={"clip_range": 0.2})
        self.assertEqual(config.algorithm.policy_loss_fn_args["loss_agg_mode"], MODE)
        config = validated("dpo", loss_agg_mode=MODE)
        self.assertNotIn("loss_agg_mode", config.algorithm.policy_loss_fn_args)

    def test_a_mode_written_only_in_the_loss_args_is_the_algorithms_and_logged(self):
        """0.6.0 replaced such a mode with token-mean: such a config now trains otherwise."""
        with mock.patch("trinity.common.config_validator.get_logger") as get_logger:
            config = validated(loss_args={"clip_range": 0.2, "loss_agg_mode": MODE})
        self.assertEqual(config.algorithm.loss_agg_mode, MODE)
        lines = [call.args[0] for call in get_logger.return_value.warning.mock_calls]
        self.assertEqual(len([line for line in lines if MODE in line]), 1, lines)

    def test_two_different_modes_written_are_refused_naming_both(self):
        """Either one in either place (0.6.0 let the algorithm's win); the same twice is fine."""
        for first, second in (("token-mean", MODE), (MODE, "token-mean")):
            both = dict(loss_agg_mode=first, loss_args={"clip_range": 0.2, "loss_agg_mode": second})
            with self.assertRaisesRegex(ValueError, f"is {first} but .*loss_agg_mode` is {second}"):
                validated(**both)
        same = validated(loss_agg_mode=MODE, loss_args={"clip_range": 0.2, "loss_agg_mode": MODE})
        self.assertEqual(same.algorithm.policy_loss_fn_args["loss_agg_mode"], MODE)

    def test_an_unwritten_mode_stays_as_released(self):
        """GSPO: token-mean with no loss arguments, its constructor's default with some."""
        args = validated("gspo").algorithm.policy_loss_fn_args
        self.assertEqual(args["loss_agg_mode"], "token-mean")
        args = validated("gspo", loss_args={"clip_range": 0.2}).algorithm.policy_loss_fn_args
        self.assertNotIn("loss_agg_mode", args)  # GSPOPolicyLossFn's seq-mean-token-mean

    def test_an_unknown_key_of_every_policy_loss_fails_naming_it_and_the_known_keys(self):
        """A typo, and `backend`, which the trainer passes itself; the loss's own keys pass."""
        for name in LOSSES:
            validated(policy_loss_fn=name, loss_args=POLICY_LOSS_FN.get(name).default_args())
            for key in ("clip_rnage", "backend"):
                args = {**POLICY_LOSS_FN.get(name).default_args(), key: 0.2}
                with self.assertRaisesRegex(ValueError, f"`{name}`.*`{key}`") as raised:
                    validated(policy_loss_fn=name, loss_args=args)
                for known in POLICY_LOSS_FN.get(name).default_args():
                    self.assertIn(f"`{known}`", str(raised.exception))

    def test_the_loss_is_built_with_the_backend_of_the_trainer_that_trains(self):
        """Tinker, enabled or named as the trainer, builds it with `tinker`; verl with `verl`."""
        init = PPOPolicyLossFn.__init__
        cases = [({"tinker": True}, "tinker"), ({"trainer_type": "tinker"}, "tinker"), ({}, "verl")]
        for trainer, backend in cases:
            with mock.patch.object(
                PPOPolicyLossFn, "__init__", autospec=True, side_effect=init
            ) as built:
                validated(loss_args={"clip_range": 0.2}, **trainer)
            self.assertEqual(built.call_args.kwargs["backend"], backend, trainer)

    def test_a_value_the_constructor_refuses_fails_at_validation(self):
        """PPO asserts its dual clip; the ValueError carries the constructor's message.

        Another error of the constructor (a bug, not a refusal) passes unchanged.
        """
        with self.assertRaisesRegex(ValueError, "`ppo`: clip_ratio_c must be greater"):
            validated(loss_args={"clip_range": 0.2, "clip_ratio_c": 0.5})
        validated(loss_args={"clip_range": 0.2, "clip_ratio_c": 1.5})  # the control
        broken = mock.patch.object(PPOPolicyLossFn, "__init__", side_effect=RuntimeError("bug"))
        with broken, self.assertRaisesRegex(RuntimeError, "^bug$"):
            validated(loss_args={"clip_range": 0.2})


if __name__ == "__main__":
    unittest.main()
