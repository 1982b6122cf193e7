# -*- coding: utf-8 -*-
"""Test where algorithm.loss_agg_mode and the policy loss's loss_agg_mode come from.

The trainer aggregates the KL and entropy terms with ``algorithm.loss_agg_mode`` and the policy
loss uses its own ``loss_agg_mode`` argument. Every registered algorithm preset is validated with
the mode written nowhere, at algorithm level, in the loss arguments, or in both, each with no
other loss argument and with the loss's other arguments written. A written mode must be the one
both use; where none is written, each loss must keep the mode trinity-rft 0.6.0 gave it.
"""

import inspect
import unittest
from unittest import mock

from trinity.algorithm import ALGORITHM_TYPE, POLICY_LOSS_FN
from trinity.common.config import Config, ExperienceBufferConfig
from trinity.common.config_validator import AlgorithmConfigValidator

ALGORITHM_MODE = "seq-mean-token-sum"  # no loss and no preset defaults to either mode
LOSS_ARGS_MODE = "seq-mean-token-sum-norm"


def preset_names() -> list:
    """Every name registered in ALGORITHM_TYPE, the lazily imported ones included."""
    return sorted(set(ALGORITHM_TYPE._default_mapping) | set(ALGORITHM_TYPE.modules))


def preset_loss(preset: str):
    """The policy loss class a preset trains with when the config names none."""
    return POLICY_LOSS_FN.get(
        ALGORITHM_TYPE.get(preset).default_config().get("policy_loss_fn", "ppo")
    )


def constructor_mode(loss_cls):
    """The mode a loss is built with when its args leave it out; None if it takes no mode."""
    parameter = inspect.signature(loss_cls).parameters.get("loss_agg_mode")
    return None if parameter is None else parameter.default


def arg_shapes(preset: str) -> dict:
    """The loss args written besides the mode: none, and the loss's other default arguments.

    A loss whose only argument is the mode (SFT's) gets an empty dict in the second shape, which
    is written args all the same: the validator then fills in no defaults.
    """
    defaults = preset_loss(preset).default_args()
    return {
        "no args": None,
        "other args": {key: value for key, value in defaults.items() if key != "loss_agg_mode"},
    }


def validated(preset: str, loss_agg_mode=None, loss_args=None) -> Config:
    """Run the algorithm validator on a config with only these algorithm fields written.

    Args:
        preset: The algorithm_type.
        loss_agg_mode: algorithm.loss_agg_mode as written, None for not written.
        loss_args: policy_loss_fn_args as written, None for not written.

    Returns:
        The validated config.
    """
    config = Config()
    # SFT, CPT and DPO validate only in train mode, with an experience buffer path; the other
    # presets do not look at either.
    config.mode = "train"
    config.buffer.trainer_input.experience_buffer = ExperienceBufferConfig(
        name="experience", path="experience.jsonl"
    )
    config.algorithm.algorithm_type = preset
    config.algorithm.loss_agg_mode = loss_agg_mode
    config.algorithm.policy_loss_fn_args = None if loss_args is None else dict(loss_args)
    AlgorithmConfigValidator().validate(config)
    return config


def effective_modes(config: Config) -> tuple:
    """(policy loss mode as the loss would be built, algorithm.loss_agg_mode) after validation."""
    loss_cls = POLICY_LOSS_FN.get(config.algorithm.policy_loss_fn)
    args = config.algorithm.policy_loss_fn_args or {}  # never None once validated
    return args.get("loss_agg_mode", constructor_mode(loss_cls)), config.algorithm.loss_agg_mode


def released_modes(preset: str, loss_args) -> tuple:
    """The modes trinity-rft 0.6.0 gives when no mode is written, for comparison.

    A literal transcription of the 0.6.0 validator's rule, kept apart from the code under test:
    the algorithm's mode is the preset's, else token-mean; the loss args are the written ones,
    else the preset's, else the loss's default_args; the algorithm's mode replaces the mode in
    those args only where they hold the key, and a loss whose args lack it is built with its
    constructor's default.

    Args:
        preset: The algorithm_type.
        loss_args: policy_loss_fn_args as written (without a mode), None for not written.

    Returns:
        (policy loss mode, algorithm.loss_agg_mode).
    """
    defaults = {"policy_loss_fn": "ppo", "loss_agg_mode": "token-mean"}
    defaults.update(ALGORITHM_TYPE.get(preset).default_config())
    loss_cls = POLICY_LOSS_FN.get(defaults["policy_loss_fn"])
    if loss_args is None:
        loss_args = defaults.get("policy_loss_fn_args", loss_cls.default_args())
    if "loss_agg_mode" in loss_args:
        return defaults["loss_agg_mode"], defaults["loss_agg_mode"]
    return constructor_mode(loss_cls), defaults["loss_agg_mode"]


class LossAggModeConfigTest(unittest.TestCase):
    """Each way of writing the mode, for every preset and both shapes of the loss args."""

    maxDiff = None  # a failure lists every preset that differs

    def check_written(self, algorithm_mode, loss_args_mode, expected_mode):
        """Validate every preset with the mode written as given, and compare.

        Args:
            algorithm_mode: algorithm.loss_agg_mode as written, None for not written.
            loss_args_mode: The mode written in policy_loss_fn_args, None for not written.
            expected_mode: The mode the policy loss and the trainer must both use.
        """
        mismatches, cases = [], 0
        for preset in preset_names():
            takes_mode = constructor_mode(preset_loss(preset)) is not None
            if loss_args_mode is not None and not takes_mode:
                continue  # a mode in the args of a loss that takes none is a config error
            for shape, other_args in arg_shapes(preset).items():
                loss_args = other_args
                if loss_args_mode is not None:
                    loss_args = {**(other_args or {}), "loss_agg_mode": loss_args_mode}
                actual = effective_modes(validated(preset, algorithm_mode, loss_args))
                expected = (expected_mode if takes_mode else None, expected_mode)
                cases += 1
                if actual != expected:
                    mismatches.append(f"{preset}, {shape}: {actual} instead of {expected}")
        self.assertGreater(cases, 0)
        self.assertEqual(mismatches, [])

    def test_unwritten_mode_is_the_released_one(self):
        """With no mode written, every loss and the trainer keep 0.6.0's modes."""
        mismatches = []
        for preset in preset_names():
            for shape, loss_args in arg_shapes(preset).items():
                actual = effective_modes(validated(preset, None, loss_args))
                expected = released_modes(preset, loss_args)
                if actual != expected:
                    mismatches.append(f"{preset}, {shape}: {actual} instead of {expected}")
        self.assertEqual(mismatches, [])

    def test_gspo_keeps_its_released_modes(self):
        """GSPO, mode unwritten: token-mean with no args, its constructor's default with some."""
        self.assertEqual(effective_modes(validated("gspo")), ("token-mean", "token-mean"))
        self.assertEqual(
            effective_modes(validated("gspo", None, {"clip_range": 0.2})),
            ("seq-mean-token-mean", "token-mean"),
        )

    def test_algorithm_level_mode_reaches_the_loss(self):
        """A mode written at algorithm level is the policy loss's too, whatever args are set."""
        self.check_written(ALGORITHM_MODE, None, ALGORITHM_MODE)

    def test_mode_in_loss_args_only_is_the_algorithms(self):
        """A mode written only in the loss args is the trainer's mode too."""
        self.check_written(None, LOSS_ARGS_MODE, LOSS_ARGS_MODE)

    def test_a_mode_taken_from_the_loss_args_is_logged(self):
        """0.6.0 replaced such a mode with token-mean: such a config now trains otherwise."""
        for algorithm_mode, logged in ((None, 1), (ALGORITHM_MODE, 0)):
            with mock.patch("trinity.common.config_validator.get_logger") as get_logger:
                validated("grpo", algorithm_mode, {"loss_agg_mode": LOSS_ARGS_MODE})
            lines = [call.args[0] for call in get_logger.return_value.warning.mock_calls]
            lines = [line for line in lines if "policy_loss_fn_args" in line]
            self.assertEqual(len(lines), logged, lines)
            self.assertTrue(all(LOSS_ARGS_MODE in line for line in lines))

    def test_algorithm_level_mode_wins_when_both_are_written(self):
        """Written in both places, the algorithm-level mode is the one both use."""
        self.check_written(ALGORITHM_MODE, LOSS_ARGS_MODE, ALGORITHM_MODE)


if __name__ == "__main__":
    unittest.main()
