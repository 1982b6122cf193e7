# -*- coding: utf-8 -*-
"""Test for the BAPO policy loss.

The expected values were computed independently of this implementation: by a plain-Python,
loop-by-loop transcription of the paper's Algorithm 1 (and of the authors' lower-bound-first
order), which recomputes the positive contribution (Eq. 8) from the tokens for every candidate
pair, and of the clipped loss at the chosen pair, in float64, on the inputs built in setUp. Such
a transcription is written out below and checked against the loss on seeded random inputs. With
both ranges collapsed to points, BAPO is PPOPolicyLossFn's clip at those bounds.
"""

import math
import unittest
from fractions import Fraction

import torch
from verl import DataProto

from trinity.algorithm.policy_loss_fn import POLICY_LOSS_FN
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn


def reference_rho(tokens, c_low, c_high):
    """Eq. 8's positive share P / (P + N) at one pair, over the (ratio, advantage) tokens."""
    positive = sum(a * min(r, c_high) for r, a in tokens if a > 0)
    negative = sum(-a * max(r, c_low) for r, a in tokens if a < 0)
    return 1.0 if positive + negative == 0 else positive / (positive + negative)


def reference_search(tokens, args):
    """Algorithm 1 (upper_first) or the authors' two loops (lower_first), as written."""
    low, low_max, low_step, high, high_max, high_step = (
        Fraction(repr(args[f"ratio_{side}_{part}"]))
        for side in ("lower", "upper")
        for part in ("start", "max", "step")
    )

    def below_target():
        return reference_rho(tokens, float(low), float(high)) < args["positive_contribution_target"]

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
    """BAPO on fixed random inputs: the chosen clip pair, the loss there, and its metrics."""

    def setUp(self):
        """Build the inputs Trinity's policy loss tests use (seed 42, 5 x 20 tokens)."""
        seed = 42
        torch.manual_seed(seed)
        torch.cuda.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

        shape = (5, 20)
        self.logprob = 2 * torch.rand(shape) - 1
        self.input_data = DataProto.from_dict(
            {
                "old_log_probs": 2 * torch.rand(shape) - 1,
                "ref_log_prob": 2 * torch.rand(shape) - 1,
                "response_mask": torch.rand(shape) > 0.5,
                "advantages": 2 * torch.rand(shape) - 1,
            }
        )

    def run_bapo(self, advantage_shift=0.0, **overrides):
        """Call the registered `bapo` loss with its defaults, updated by `overrides`."""
        policy_loss_fn_cls = POLICY_LOSS_FN.get("bapo")
        policy_loss_fn_args = {**policy_loss_fn_cls.default_args(), **overrides}
        policy_loss_fn = policy_loss_fn_cls(**policy_loss_fn_args)
        batch = dict(self.input_data.batch)
        batch["advantages"] = batch["advantages"] + advantage_shift
        return policy_loss_fn(log_prob=self.logprob, **batch)

    def check(self, loss, metrics, expected):
        """Compare the loss and every metric named in `expected`."""
        self.assertTrue(torch.allclose(loss, torch.tensor(expected["pg_loss"])))
        for key, value in expected.items():
            self.assertTrue(
                torch.allclose(torch.tensor(metrics[key]), torch.tensor(value)),
                f"{key}: got {metrics[key]}, expected {value}",
            )

    def test_bapo_policy_loss(self):
        """Paper defaults: the upper bound walks to 2.95, where rho first reaches 0.4."""
        loss, metrics = self.run_bapo()
        expected = {
            "pg_loss": 0.1348264004709625,
            "pg_clipfrac": 0.25,
            "pg_clipfrac_lower": 0.0625,
            "ppo_kl": -0.2166344771782557,
            "bapo_clip_low": 0.6,
            "bapo_clip_high": 2.95,
            "bapo_search_steps": 35,
            "bapo_positive_contribution": 0.4002446567211415,
            "bapo_target_met": 1.0,
        }
        self.check(loss, metrics, expected)

    def test_bapo_policy_loss_target_met_at_start(self):
        """Positive advantages dominate: the start pair already meets the target."""
        loss, metrics = self.run_bapo(advantage_shift=0.3)
        expected = {
            "pg_loss": -0.08965906294561911,
            "pg_clipfrac": 0.25,
            "pg_clipfrac_lower": 0.041666666666666664,
            "ppo_kl": -0.2166344771782557,
            "bapo_clip_low": 0.6,
            "bapo_clip_high": 1.2,
            "bapo_search_steps": 0,
            "bapo_positive_contribution": 0.5770581308765775,
            "bapo_target_met": 1.0,
        }
        self.check(loss, metrics, expected)

    def test_bapo_policy_loss_authors_order(self):
        """The authors' settings: lower bound first, both ranges walked, target 0.5 not met."""
        loss, metrics = self.run_bapo(
            search_order="lower_first",
            positive_contribution_target=0.5,
            ratio_lower_max=0.8,
            ratio_lower_step=0.05,
            ratio_upper_max=2.0,
        )
        expected = {
            "pg_loss": 0.21003936676652427,
            "pg_clipfrac": 0.3333333333333333,
            "pg_clipfrac_lower": 0.0625,
            "ppo_kl": -0.2166344771782557,
            "bapo_clip_low": 0.8,
            "bapo_clip_high": 2.0,
            "bapo_search_steps": 20,
            "bapo_positive_contribution": 0.33931908214780615,
            "bapo_target_met": 0.0,
        }
        self.check(loss, metrics, expected)

    def test_bapo_search_matches_a_literal_algorithm_one(self):
        """Seeded random micro-batches (float64): the loss's pair is the reference's pair."""
        policy_loss_fn_cls = POLICY_LOSS_FN.get("bapo")
        authors_grid = {"ratio_lower_max": 0.8, "ratio_lower_step": 0.05, "ratio_upper_max": 2.0}
        pairs = set()
        for seed in range(8):
            generator = torch.Generator().manual_seed(seed)
            shape = (4, 16)
            old_logprob = -torch.rand(shape, generator=generator, dtype=torch.float64)
            logprob = old_logprob + 0.6 * torch.randn(
                shape, generator=generator, dtype=torch.float64
            )
            shift = 0.15 * (seed - 4)  # from mostly negative to mostly positive advantages
            advantages = torch.randn(shape, generator=generator, dtype=torch.float64) + shift
            mask = torch.rand(shape, generator=generator) > 0.2
            tokens = [
                (math.exp(lp - old), a)
                for lp, old, a, m in zip(
                    logprob.flatten().tolist(),
                    old_logprob.flatten().tolist(),
                    advantages.flatten().tolist(),
                    mask.flatten().tolist(),
                )
                if m
            ]
            for search_order, grid in (("upper_first", {}), ("lower_first", authors_grid)):
                args = {**policy_loss_fn_cls.default_args(), **grid, "search_order": search_order}
                _, metrics = policy_loss_fn_cls(**args)(
                    logprob=logprob,
                    old_log_probs=old_logprob,
                    response_mask=mask,
                    advantages=advantages,
                )
                got = (metrics["bapo_clip_low"], metrics["bapo_clip_high"])
                self.assertEqual(got, reference_search(tokens, args), (seed, args))
                pairs.add(got)
        self.assertGreater(len(pairs), 4)  # start pairs, mid-path stops and ends of the grids

    def test_bapo_counts_an_overflowing_float16_ratio_as_eq8(self):
        """A ratio of exp(12), inf in float16, counts as Eq. 8 says: min(inf, c_high) = c_high.

        Eq. 8 counts a token in P only where A > 0 and in N only where A < 0, so P = c_high and
        N = 3 max(1, c_low) = 3: rho = c_high / (c_high + 3) first reaches 0.4 at c_high = 2.0.
        The zero-advantage token with an inf ratio counts nowhere.
        """
        logprob = torch.tensor([[12.0, 0.0, 0.0, 0.0, 12.0]], dtype=torch.float16)
        advantages = torch.tensor([[1.0, -1.0, -1.0, -1.0, 0.0]], dtype=torch.float16)
        _, metrics = POLICY_LOSS_FN.get("bapo")()(
            logprob=logprob,
            old_log_probs=torch.zeros_like(logprob),
            response_mask=torch.ones_like(logprob),
            advantages=advantages,
        )
        got = [metrics[f"bapo_{key}"] for key in ("clip_low", "clip_high", "search_steps")]
        self.assertEqual(got, [0.6, 2.0, 16])
        self.assertEqual(metrics["bapo_positive_contribution"], 0.4)

    def test_bapo_refuses_a_lower_range_without_room_under_upper_first(self):
        """Algorithm 1 raises c_high only while c_low has room; the config would never adapt."""
        policy_loss_fn_cls = POLICY_LOSS_FN.get("bapo")
        point = {"ratio_lower_start": 0.8, "ratio_lower_max": 0.8}
        with self.assertRaisesRegex(ValueError, "room.*lower_first"):
            policy_loss_fn_cls(**point)
        policy_loss_fn_cls(**point, search_order="lower_first")
        policy_loss_fn_cls(**point, ratio_upper_start=1.2, ratio_upper_max=1.2)  # PPO's clip

    def test_bapo_with_point_ranges_is_ppo(self):
        """Ranges collapsed to (0.8, 1.28): PPO's loss, gradient and metrics, in every mode."""
        points = {"ratio_lower_start": 0.8, "ratio_lower_max": 0.8}
        points.update(ratio_upper_start=1.28, ratio_upper_max=1.28)
        modes = [
            "token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-mean",
            "seq-mean-token-sum-norm",
        ]
        for loss_agg_mode in modes:
            results = []
            for policy_loss_fn in (
                POLICY_LOSS_FN.get("bapo")(**points, loss_agg_mode=loss_agg_mode),
                PPOPolicyLossFn(
                    clip_range_low=0.2, clip_range_high=0.28, loss_agg_mode=loss_agg_mode
                ),
            ):
                logprob = self.logprob.clone().requires_grad_(True)
                loss, metrics = policy_loss_fn(log_prob=logprob, **self.input_data.batch)
                loss.backward()
                results.append((loss.detach(), logprob.grad, metrics))
            (loss, grad, metrics), (ppo_loss, ppo_grad, ppo_metrics) = results
            self.assertTrue(torch.allclose(loss, ppo_loss), loss_agg_mode)
            self.assertTrue(torch.allclose(grad, ppo_grad), loss_agg_mode)
            self.assertGreater(grad.abs().sum().item(), 0)
            self.assertGreater(ppo_metrics["pg_clipfrac"], 0)
            for key, value in ppo_metrics.items():
                self.assertAlmostEqual(metrics[key], value, places=6, msg=(loss_agg_mode, key))
            self.assertEqual((metrics["bapo_clip_low"], metrics["bapo_clip_high"]), (0.8, 1.28))
