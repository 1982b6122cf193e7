"""Print the expected values of tests/algorithm/bapo_policy_loss_test.py, from the oracle alone.

The unit test that goes upstream states its expectations as numbers, as Trinity's policy loss
tests do. This script produces them without the code under test: it builds the test's own inputs
(its setUp), picks the pair with the literal Algorithm 1 / authors'-order loops of
tests/bapo_reference.py, and computes the clipped loss and its metrics at that pair in plain
Python over float64 token values. Run: .venv/bin/python tests/bapo_expected_values.py
(beside the oracle, so both import without any path set up)
"""

import math

from algorithm.bapo_policy_loss_test import BAPOPolicyLossTest
from bapo_reference import algorithm1, authors_order, rho
from trinity.algorithm.policy_loss_fn import POLICY_LOSS_FN

AUTHORS = {
    "search_order": "lower_first",
    "positive_contribution_target": 0.5,
    "ratio_lower_max": 0.8,
    "ratio_lower_step": 0.05,
    "ratio_upper_max": 2.0,
}
# test method -> (advantage shift, argument overrides), as the test methods call run_bapo
CASES: dict[str, tuple[float, dict]] = {
    "test_bapo_policy_loss": (0.0, {}),
    "test_bapo_policy_loss_target_met_at_start": (0.3, {}),
    "test_bapo_policy_loss_gradient_contribution": (0.15, {"contribution": "gradient"}),
    "test_bapo_policy_loss_authors_order": (0.0, AUTHORS),
}


def tokens(shift: float) -> list[tuple[float, float, float]]:
    """(log-ratio, ratio, advantage) of every unmasked token of the test's inputs."""
    case = BAPOPolicyLossTest()
    case.setUp()
    batch = case.input_data.batch
    rows = zip(
        case.logprob.flatten().tolist(),
        batch["old_log_probs"].flatten().tolist(),
        batch["response_mask"].flatten().tolist(),
        (batch["advantages"] + shift).flatten().tolist(),
    )
    out = []
    for logprob, old, mask, advantage in rows:
        if mask:
            log_ratio = min(max(logprob - old, -20.0), 20.0)
            out.append((log_ratio, math.exp(log_ratio), advantage))
    return out


def expected(shift: float, overrides: dict) -> dict[str, float]:
    """The pair from the literal search, then PPO's clipped loss (token-mean) at that pair."""
    args = {**POLICY_LOSS_FN.get("bapo").default_args(), **overrides}
    toks = tokens(shift)
    pairs = [(r, a) for _, r, a in toks]
    search = algorithm1 if args["search_order"] == "upper_first" else authors_order
    a_lo, b_lo, d_lo = (args[f"ratio_lower_{part}"] for part in ("start", "max", "step"))
    a_hi, b_hi, d_hi = (args[f"ratio_upper_{part}"] for part in ("start", "max", "step"))
    target, contribution, dual_clip = (
        args[k] for k in ("positive_contribution_target", "contribution", "clip_ratio_c")
    )
    grid = (a_lo, b_lo, d_lo, a_hi, b_hi, d_hi)
    low, high, steps = search(pairs, *grid, target, contribution, dual_clip)
    share = rho(pairs, low, high, contribution, dual_clip)
    losses, clipped_count, dual_count = [], 0, 0
    for _, r, a in toks:
        unclipped, clipped = -a * r, -a * min(max(r, low), high)
        clipped_count += clipped > unclipped
        loss = max(unclipped, clipped)
        if a < 0:
            dual_count += loss > -a * dual_clip
            loss = min(loss, -a * dual_clip)
        losses.append(loss)
    return {
        "pg_loss": sum(losses) / len(toks),
        "pg_clipfrac": clipped_count / len(toks),
        "pg_clipfrac_lower": dual_count / len(toks),
        "ppo_kl": sum(-lr for lr, _, _ in toks) / len(toks),
        "bapo_clip_low": low,
        "bapo_clip_high": high,
        "bapo_search_steps": steps,
        "bapo_positive_contribution": share,
        "bapo_target_met": float(share >= target),
    }


if __name__ == "__main__":
    for name, (shift, overrides) in CASES.items():
        print(f"{name}: {expected(shift, overrides)}")
