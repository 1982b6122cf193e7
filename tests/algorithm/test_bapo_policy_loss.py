# -*- coding: utf-8 -*-
"""Test for the BAPO policy loss: its pair against a literal Algorithm 1, PPO at point ranges."""

import math
import unittest
from fractions import Fraction

import torch
from verl import DataProto

from trinity.algorithm.policy_loss_fn import POLICY_LOSS_FN
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn


def reference_search(tokens, args):
    """Algorithm 1 (upper_first) or the authors' loops, with Eq. 8 recomputed at every pair."""
    low, low_max, low_step, high, high_max, high_step = (
        Fraction(repr(args[f"ratio_{side}_{part}"]))
        for side in ("lower", "upper")
        for part in ("start", "max", "step")
    )

    def below_target():  # Eq. 8: rho = P / (P + N), 1 where no token counts
        positive = sum(a * min(r, float(high)) for r, a in tokens if a > 0)
        negative = sum(-a * max(r, float(low)) for r, a in tokens if a < 0)
        rho = 1.0 if positive + negative == 0 else positive / (positive + negative)
        return rho < args["positive_contribution_target"]

    if args["search_order"] == "upper_first":
        while below_target() and low + low_step <= low_max:
            if high + high_step <= high_max:
                high += high_step
            else:
                low += low_step
    else:
        while below_target() and low < low_max:
            low = min(low + low_step, low_max)
        while below_target() and high < high_max:
            high = min(high + high_step, high_max)
    return float(low), float(high)


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
        """Seeded micro-batches, from mostly negative to mostly positive advantages, and a tie.

        The tie: rho = 2 / (2 + 3) is rho0 exactly at the start pair, which therefore stays.
        """
        bapo = POLICY_LOSS_FN.get("bapo")
        authors = {"ratio_lower_max": 0.8, "ratio_lower_step": 0.05, "ratio_upper_max": 2.0}
        pairs, tie = set(), torch.tensor([[2.0, -3.0]], dtype=torch.float64)
        for seed in range(9):
            gen = torch.Generator().manual_seed(seed)
            old = -torch.rand(4, 16, generator=gen, dtype=torch.float64)
            lp = old + 0.6 * torch.randn(4, 16, generator=gen, dtype=torch.float64)
            adv = torch.randn(4, 16, generator=gen, dtype=torch.float64) + 0.15 * (seed - 4)
            mask = torch.rand(4, 16, generator=gen) > 0.2
            if seed == 8:
                lp, old, adv, mask = tie * 0, tie * 0, tie, tie != 0
            tokens = list(zip((lp - old).exp()[mask].tolist(), adv[mask].tolist()))
            for order, grid in (("upper_first", {}), ("lower_first", authors)):
                args = {**bapo.default_args(), **grid, "search_order": order}
                _, metrics = bapo(**args)(
                    logprob=lp, old_logprob=old, action_mask=mask, advantages=adv
                )
                got = (metrics["bapo_clip_low"], metrics["bapo_clip_high"])
                self.assertEqual(got, reference_search(tokens, args), (seed, order))
                pairs.add(got)
        self.assertEqual(metrics["bapo_positive_contribution"], 0.4)  # the tie
        self.assertGreater(len(pairs), 4)  # start pairs, mid-path stops and ends of the grids

    def test_bapo_with_point_ranges_is_ppo(self):
        """Ranges collapsed to (0.8, 1.28): PPO's loss, gradient and metrics, for each setting."""
        points = {"ratio_lower_start": 0.8, "ratio_lower_max": 0.8}
        points.update(ratio_upper_start=1.28, ratio_upper_max=1.28)
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
            {"ratio_lower_step": 1e-18, "ratio_lower_start": 0.9, "ratio_lower_max": 0.9 + 2e-16},
            {"ratio_upper_max": 1e9},  # past exp(20), the largest ratio PPO's clamp leaves
            {"positive_contribution_target": math.nan},
            {"sync_across_dp": "false"},
            {"search_order": "upper"},
            {"loss_agg_mode": "mean"},
            {"ratio_lower_max": 0.6},  # upper_first: c_high would never move
        ]
        for args in bad:
            with self.subTest(args), self.assertRaisesRegex(ValueError, f"`{next(iter(args))}"):
                POLICY_LOSS_FN.get("bapo")(**args)


if __name__ == "__main__":
    unittest.main()
