"""The clipping schemes the study compares, each as a Trinity ``AlgorithmConfig``.

Every variant is a registered Trinity policy loss (``ppo`` or ``bapo``), built by
``TrinityPolicyLoss``; only the loss arguments differ. ``start`` is the pair the variant uses
when nothing moves it, so a step "moved the bounds" when a call used another pair.
"""

from typing import Dict, List, NamedTuple


class Variant(NamedTuple):
    """A named loss configuration."""

    name: str
    label: str
    loss: str
    args: Dict
    start: List[float]


def _bapo(**overrides) -> Dict:
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    args = BAPOPolicyLossFn.default_args()
    args.update(overrides)
    return args


def all_variants() -> List[Variant]:
    """The six variants, in the order the table lists them."""
    return [
        Variant(
            "ppo",
            "PPO (0.8, 1.2)",
            "ppo",
            {"clip_range_low": 0.2, "clip_range_high": 0.2},
            [0.8, 1.2],
        ),
        Variant(
            "ppo_clip_higher",
            "PPO clip-higher (0.8, 1.28)",
            "ppo",
            {"clip_range_low": 0.2, "clip_range_high": 0.28},
            [0.8, 1.28],
        ),
        Variant(
            "bapo_fixed_start",
            "ablation: BAPO start pair fixed (0.6, 1.2)",
            "bapo",
            _bapo(ratio_lower_max=0.6, ratio_upper_max=1.2),
            [0.6, 1.2],
        ),
        Variant("bapo_paper", "BAPO, paper defaults", "bapo", _bapo(), [0.6, 1.2]),
        Variant(
            "bapo_gradient",
            "BAPO, contribution: gradient",
            "bapo",
            _bapo(contribution="gradient"),
            [0.6, 1.2],
        ),
        Variant(
            "bapo_authors",
            "BAPO, authors' settings",
            "bapo",
            _bapo(
                search_order="lower_first",
                positive_contribution_target=0.5,
                ratio_lower_max=0.8,
                ratio_lower_step=0.05,
                ratio_upper_max=2.0,
                ratio_upper_step=0.05,
            ),
            [0.6, 1.2],
        ),
    ]
