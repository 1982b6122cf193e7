"""The literal numbers of the upstream unit test (tests/algorithm/) are the oracle's.

That test states its expectations as literals, as Trinity's policy loss tests do; its methods
named ``test_bapo_policy_loss*`` do. Here each runs with ``check`` noting what it expects, and
the literal Algorithm 1 (or the authors' loops) of ``tests/oracle.py`` and the clipped loss in
plain Python over the test's own inputs must give the same numbers.
"""

import math

import pytest

from tests import oracle
from tests.algorithm import test_bapo_policy_loss as upstream
from trinity.algorithm.policy_loss_fn import POLICY_LOSS_FN

METHODS = [
    name for name in dir(upstream.BAPOPolicyLossTest) if name.startswith("test_bapo_policy_loss")
]


class Stated(upstream.BAPOPolicyLossTest):
    """The upstream test, noting what each method runs BAPO with and what it expects."""

    __test__ = False  # not collected again here

    def run_bapo(self, advantage_shift=0.0, **overrides):
        """Note the arguments, then run BAPO as the upstream test does."""
        self.args = {"shift": advantage_shift, "overrides": overrides}
        return super().run_bapo(advantage_shift, **overrides)

    def check(self, loss, metrics, expected):
        """Note the expectations instead of checking them."""
        self.seen.append({**self.args, "expected": expected})


def expected(case, shift, overrides):
    """The pair from the literal search, then PPO's clipped token-mean loss and metrics there."""
    args = {**POLICY_LOSS_FN.get("bapo").default_args(), **overrides}
    batch = case.input_data.batch
    mask, clip_c = batch["response_mask"], args["clip_ratio_c"]
    tokens = oracle.token_lists(
        case.logprob, batch["old_log_probs"], mask, batch["advantages"] + shift
    )
    low, high, steps = oracle.search(tokens, args)
    losses, clipped, dual = [], 0, 0
    for r, a in tokens:
        loss = max(-a * r, -a * min(max(r, low), high))
        clipped += loss > -a * r
        if a < 0:
            dual += loss > -a * clip_c
            loss = min(loss, -a * clip_c)
        losses.append(loss)
    share, n = oracle.rho(tokens, low, high), len(tokens)
    log_ratios = (case.logprob - batch["old_log_probs"])[mask]
    return {
        "pg_loss": sum(losses) / n,
        "pg_clipfrac": clipped / n,
        "pg_clipfrac_lower": dual / n,
        "ppo_kl": -float(log_ratios.double().sum()) / n,
        "bapo_clip_low": low,
        "bapo_clip_high": high,
        "bapo_search_steps": steps,
        "bapo_positive_contribution": share,
        "bapo_target_met": float(share >= args["positive_contribution_target"]),
    }


def test_the_literal_methods_are_found():
    assert len(METHODS) >= 3, METHODS


@pytest.mark.parametrize("method", METHODS)
def test_stated_numbers_are_the_oracles(method):
    case = Stated(method)
    case.seen = []
    case.setUp()
    getattr(case, method)()
    assert case.seen, f"{method} states no literal expectation"
    for seen in case.seen:
        want = expected(case, seen["shift"], seen["overrides"])
        assert set(seen["expected"]) == set(want)
        for key, value in want.items():
            assert math.isclose(seen["expected"][key], value, rel_tol=1e-6, abs_tol=1e-9), key
