"""The literal numbers of the upstream unit test (tests/algorithm/) are the oracle's.

That test states its expectations as literals, as Trinity's policy loss tests do. Here each of
its methods runs with ``check`` recording what it expects, and the literal Algorithm 1 (or the
authors' loops) of ``bapo_reference`` and the clipped loss in plain Python over the test's own
inputs must give the same numbers.
"""

import inspect
import math

import pytest

import algorithm.bapo_policy_loss_test as upstream
import bapo_reference as ref
from scripts.harness.cases import RANGE_ARGS
from trinity.algorithm.policy_loss_fn import POLICY_LOSS_FN


class Stated(upstream.BAPOPolicyLossTest):
    """The upstream test, noting what each method runs BAPO with and what it expects."""

    __test__ = False  # not collected again here

    def run_bapo(self, advantage_shift=0.0, **overrides):
        """Note the arguments, then run BAPO as the upstream test does."""
        self.seen = {"shift": advantage_shift, "overrides": overrides}
        return super().run_bapo(advantage_shift, **overrides)

    def check(self, loss, metrics, expected):
        """Note the expectations instead of checking them."""
        self.seen["expected"] = expected


def oracle(case, shift, overrides):
    """The pair from the literal search, then PPO's clipped token-mean loss and metrics there."""
    args = {**POLICY_LOSS_FN.get("bapo").default_args(), **overrides}
    batch = case.input_data.batch
    adv = batch["advantages"] + shift
    tokens = ref.token_lists(case.logprob, batch["old_log_probs"], batch["response_mask"], adv)
    search = ref.algorithm1 if args["search_order"] == "upper_first" else ref.authors_order
    grid = [args[name] for name in RANGE_ARGS]
    rule = (args["contribution"], args["clip_ratio_c"])
    low, high, steps = search(tokens, *grid, args["positive_contribution_target"], *rule)
    losses, clipped, dual = [], 0, 0
    for r, a, _, _ in tokens:
        loss = max(-a * r, -a * min(max(r, low), high))
        clipped += loss > -a * r
        if a < 0:
            dual += loss > -a * args["clip_ratio_c"]
            loss = min(loss, -a * args["clip_ratio_c"])
        losses.append(loss)
    share, n = ref.rho(tokens, low, high, *rule), len(tokens)
    log_ratios = (case.logprob - batch["old_log_probs"])[batch["response_mask"]]
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


# The methods that state literal expectations (the others check against their own reference)
METHODS = sorted(
    name
    for name, method in vars(upstream.BAPOPolicyLossTest).items()
    if name.startswith("test_") and "self.check(" in inspect.getsource(method)
)


@pytest.mark.parametrize("method", METHODS)
def test_stated_numbers_are_the_oracles(method):
    assert len(METHODS) == 4
    case = Stated(method)
    case.setUp()
    getattr(case, method)()
    seen = case.seen
    want = oracle(case, seen["shift"], seen["overrides"])
    assert set(seen["expected"]) == set(want)
    for key, value in want.items():
        assert math.isclose(seen["expected"][key], value, rel_tol=1e-6, abs_tol=1e-9), key
