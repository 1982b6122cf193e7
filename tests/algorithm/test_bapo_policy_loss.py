# -*- coding: utf-8 -*-
"""Test for the BAPO policy loss: its pair against a literal Algorithm 1, PPO at that pair."""

import inspect
import math
import unittest
from fractions import Fraction

import torch
import yaml
from verl import DataProto

from trinity.algorithm import ALGORITHM_TYPE
from trinity.algorithm.policy_loss_fn import POLICY_LOSS_FN
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn

AUTHORS = {"ratio_lower_max": 0.8, "ratio_lower_step": 0.05, "ratio_upper_max": 2.0}
UNEVEN = {**AUTHORS, "ratio_lower_start": 0.1, "ratio_lower_step": 0.3, "ratio_upper_step": 0.25}
TWO = {"ratio_lower_max": 0.62, "ratio_upper_max": 1.25}  # two candidates on each range
POINTS = {"ratio_lower_max": 0.6, "ratio_upper_max": 1.2}  # no room: the start pair
GRIDS = [("upper_first", grid) for grid in ({}, TWO, POINTS)]
GRIDS += [("lower_first", grid) for grid in (AUTHORS, UNEVEN)]  # UNEVEN's steps: maxima capped
FINE = {"ratio_upper_step": 1e-4, "ratio_upper_start": 1.0}  # 10,000 steps to 2.0, the most


def as_read(args):
    """The arguments as Trinity reads them from a YAML file: new str and float objects."""
    return yaml.safe_load(yaml.safe_dump(args))


def reference_search(tokens, args, dtype):
    """Algorithm 1 (upper_first) or the authors' loops, with Eq. 8 recomputed at every pair.

    Bounds as PPO's clamp meets ratios of ``dtype``, rounded to it. The pair, its raises, its rho.
    """
    low, low_max, low_step, high, high_max, high_step = (
        Fraction(repr(args[f"ratio_{side}_{part}"]))
        for side in ("lower", "upper")
        for part in ("start", "max", "step")
    )

    def bound(c):
        return torch.tensor(float(c), dtype=dtype).item()

    def rho():  # Eq. 8: P / (P + N), 1 where no token counts
        positive = sum(a * min(r, bound(high)) for r, a in tokens if a > 0)
        negative = sum(-a * max(r, bound(low)) for r, a in tokens if a < 0)
        return 1.0 if positive + negative == 0 else positive / (positive + negative)

    steps, target = 0, args["positive_contribution_target"]
    if args["search_order"] == "upper_first":
        while rho() < target and low + low_step <= low_max:
            if high + high_step <= high_max:
                high += high_step
            else:
                low += low_step
            steps += 1
    else:
        while rho() < target and low < low_max:
            low, steps = min(low + low_step, low_max), steps + 1
        while rho() < target and high < high_max:
            high, steps = min(high + high_step, high_max), steps + 1
    return (float(low), float(high)), steps, rho()


def loss_and_grad(loss_fn, logprob, old_logprob, action_mask, advantages):
    """The loss, its gradient with respect to the log-probs, and the metrics of one call."""
    logprob = logprob.clone().requires_grad_(True)
    loss, metrics = loss_fn(logprob, old_logprob, action_mask, advantages)
    loss.backward()
    return loss.detach(), logprob.grad, metrics


def search_cases():
    """(name, (logprob, old_logprob, mask, advantages), rho0): seeded ones, then some by hand."""
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        old = -torch.rand(4, 16, generator=gen, dtype=torch.float64)
        lp = old + 0.6 * torch.randn(4, 16, generator=gen, dtype=torch.float64)
        adv = torch.randn(4, 16, generator=gen, dtype=torch.float64) + 0.07 * (seed - 4)
        yield f"seed {seed}", (lp, old, torch.rand(4, 16, generator=gen) > 0.2, adv), 0.4
    tie = torch.tensor([[2.0, -3.0]], dtype=torch.float64)  # rho = 2 / 5: rho0 at the start pair
    yield "tie", (tie * 0, tie * 0, tie != 0, tie), 0.4
    yield "all masked", (tie * 0, tie * 0, tie == 0, tie), 0.4  # rho is 1: the start pair
    # log r = 30, clamped to 20: rho crosses rho0 at c_high = 1.95 only with the clamp
    lp, big = torch.tensor([[30.0, math.log(3.5)]], dtype=torch.float64), math.exp(20) / 2.9
    yield "clamp", (lp, lp * 0, lp != 0, torch.tensor([[-1.0, big]], dtype=torch.float64)), 0.4
    # bfloat16 holds 1.2 as 1.203125: rho0 lies between rho at the bounds as written and as held
    lp = torch.tensor([[1.2, 1.0]], dtype=torch.bfloat16).log()
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.bfloat16)
    yield "bfloat16", (lp, lp * 0, lp == lp, adv), (1.2 / 2.2 + 1.203125 / 2.203125) / 2


class BAPOPolicyLossTest(unittest.TestCase):
    """BAPO's pair, its loss at point ranges, and its arguments."""

    def setUp(self):
        """Build the inputs Trinity's policy loss tests use (seed 42, 5 x 20 tokens)."""
        torch.manual_seed(42)
        shape = (5, 20)
        self.logprob = 2 * torch.rand(shape) - 1
        self.input_data = DataProto.from_dict(
            {
                "old_log_probs": 2 * torch.rand(shape) - 1,
                "response_mask": torch.rand(shape) > 0.5,
                "advantages": 2 * torch.rand(shape) - 1,
            }
        )

    def test_bapo_search_matches_a_literal_algorithm_one(self):
        """Each case in each order and grid; the loss and gradient are PPO's at the pair reported.

        The tie keeps the start pair: rho = rho0 is not below rho0.
        """
        bapo, pairs = POLICY_LOSS_FN.get("bapo"), set()
        for name, (lp, old, mask, adv), target in search_cases():
            ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))  # as PPO clamps log r
            tokens = list(zip(ratio[mask].tolist(), adv[mask].tolist()))
            for order, grid in GRIDS:
                args = {**bapo.default_args(), **grid, "search_order": order}
                args["positive_contribution_target"] = target
                loss, grad, metrics = loss_and_grad(bapo(**as_read(args)), lp, old, mask, adv)
                got = (metrics["bapo_clip_low"], metrics["bapo_clip_high"])
                pair, steps, rho = reference_search(tokens, args, lp.dtype)
                self.assertEqual((got, metrics["bapo_search_steps"]), (pair, steps), (name, grid))
                self.assertAlmostEqual(metrics["bapo_positive_contribution"], rho, 12, name)
                self.assertEqual(metrics["bapo_target_met"], float(rho >= target), name)
                eps = dict(clip_range_low=1 - got[0], clip_range_high=got[1] - 1)
                ppo_loss, ppo_grad, _ = loss_and_grad(PPOPolicyLossFn(**eps), lp, old, mask, adv)
                self.assertTrue(torch.allclose(loss, ppo_loss) and torch.allclose(grad, ppo_grad))
                pairs.add(got)
        self.assertGreater(len(pairs), 10)  # start pairs, mid-path stops and ends of the grids

    def test_bapo_with_point_ranges_is_ppo(self):
        """Ranges collapsed to (0.8, 1.28), as a YAML file gives them: PPO, for each setting."""
        points = as_read({"ratio_lower_start": 0.8, "ratio_lower_max": 0.8, "ratio_lower_step": 0})
        points.update(as_read({"ratio_upper_start": 1.28, "ratio_upper_max": 1.28}))
        modes = (
            "token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-mean",
            "seq-mean-token-sum-norm",
        )
        for setting in [{"loss_agg_mode": mode} for mode in modes] + [{"clip_ratio_c": 1.5}]:
            results = []
            for policy_loss_fn in (
                POLICY_LOSS_FN.get("bapo")(**points, **setting),
                PPOPolicyLossFn(clip_range_low=0.2, clip_range_high=0.28, **setting),
                PPOPolicyLossFn(clip_range_low=0.2, clip_range_high=0.28),
            ):
                logprob = self.logprob.clone().requires_grad_(True)
                loss, metrics = policy_loss_fn(log_prob=logprob, **self.input_data.batch)
                loss.backward()
                results.append((loss.detach(), logprob.grad, metrics))
            (loss, grad, metrics), (ppo_loss, ppo_grad, ppo_metrics), default = results
            self.assertTrue(torch.allclose(loss, ppo_loss) and torch.allclose(grad, ppo_grad))
            is_default = setting == {"loss_agg_mode": "token-mean"}  # the others change PPO's loss
            self.assertEqual(torch.allclose(ppo_loss, default[0]), is_default, setting)
            self.assertGreater(ppo_metrics["pg_clipfrac"], 0)
            for key, value in ppo_metrics.items():
                self.assertAlmostEqual(metrics[key], value, places=6, msg=(setting, key))

    def test_bapo_refuses_bad_arguments(self):
        """What a YAML file can hold, each refused with a ValueError naming the argument."""
        bad = [
            {"ratio_lower_start": "0.6"},
            {"ratio_lower_start": -0.1},  # a ratio bound below 0
            {"ratio_lower_max": 1.5},  # c_low past 1
            {"ratio_upper_start": 0.9},  # c_high below 1
            {"ratio_upper_max": 1e9},  # past exp(20), the largest ratio PPO's clamp leaves
            {"ratio_lower_step": 1e-18, "ratio_lower_start": 0.9, "ratio_lower_max": 0.9 + 2e-16},
            {"ratio_lower_step": -0.02, "ratio_lower_max": 0.6},  # a point's step too
            {"ratio_lower_step": 0.0},
            {**FINE, "ratio_upper_max": 2.00005},  # 10,000.5 steps
            {"clip_ratio_c": 1.0},  # PPO's dual clip needs C > 1
            {"clip_ratio_c": 0.5},
            {"positive_contribution_target": math.nan},
            {"positive_contribution_target": -0.1},
            {"positive_contribution_target": 1.1},
            {"sync_across_dp": "false"},
            {"search_order": "upper"},
            {"loss_agg_mode": "mean"},
            {"ratio_lower_max": 0.6},  # upper_first: c_high would never move
            {"ratio_lower_max": 0.6, "ratio_upper_max": 1.25},  # nor with two candidates
        ]
        for args in bad:
            with self.subTest(args), self.assertRaisesRegex(ValueError, f"`{next(iter(args))}"):
                POLICY_LOSS_FN.get("bapo")(**as_read(args))
        edges = [{"positive_contribution_target": 0.0}, {"positive_contribution_target": 1.0}]
        edges += [{"ratio_lower_start": 0.0, "ratio_lower_step": 0.3}, {"ratio_lower_max": 1.0}]
        edges += [{"ratio_upper_start": 1.0}, {"clip_ratio_c": 1.5}, {**FINE, "ratio_upper_max": 2}]
        for args in edges:  # each at the edge of its range
            with self.subTest(args):
                built = POLICY_LOSS_FN.get("bapo")(**as_read(args))
        self.assertEqual(len(built.upper), 10_001)  # FINE's: 10,000 steps and the start

    def test_the_defaults_are_the_papers(self):
        """Sec. 5.1 in Algorithm 1's order, synchronised: the constructor's and default_args'."""
        bapo, paper = POLICY_LOSS_FN.get("bapo"), dict(ratio_lower_start=0.6, ratio_lower_max=0.9)
        paper.update(ratio_lower_step=0.02, ratio_upper_start=1.2, ratio_upper_max=3.0)
        paper.update(ratio_upper_step=0.05, positive_contribution_target=0.4, clip_ratio_c=3.0)
        paper.update(search_order="upper_first", loss_agg_mode="token-mean", sync_across_dp=True)
        defaults, written = inspect.signature(bapo).parameters, bapo.default_args()
        self.assertEqual({key: written[key] for key in paper}, paper)
        self.assertEqual({key: defaults[key].default for key in paper}, paper)

    def test_the_preset_is_grpos_advantage_with_the_bapo_loss_alone(self):
        """`algorithm_type: bapo`: GRPO's advantage, the bapo loss; no critic, KL or entropy."""
        preset, grpo = (ALGORITHM_TYPE.get(name) for name in ("bapo", "grpo"))
        config = preset.default_config()
        for key in ("advantage_fn", "repeat_times", "sample_strategy"):
            self.assertEqual(config[key], grpo.default_config()[key], key)
        self.assertEqual(config["policy_loss_fn"], "bapo")
        self.assertFalse(preset.use_critic or preset.use_reference)
        for flag in ("compute_advantage_in_trainer", "can_balance_batch", "schema"):
            self.assertEqual(getattr(preset, flag), getattr(grpo, flag), flag)
        for term in ("kl_penalty_fn", "kl_loss_fn", "entropy_loss_fn"):
            self.assertEqual(config[term], "none", term)


if __name__ == "__main__":
    unittest.main()
