"""The clipping schemes compared, each a registered Trinity policy loss with its arguments."""

from typing import Any, Dict, List, NamedTuple, Tuple


class Variant(NamedTuple):
    """A named loss configuration; ``start`` is its pair when nothing moves the bounds."""

    name: str
    label: str
    loss: str
    args: Dict
    start: List[float]


def loss_config(name: str, args: dict):
    """Trinity's AlgorithmConfig for ``TrinityPolicyLoss``: ``name`` with ``args``, token-mean."""
    from trinity.common.config import AlgorithmConfig

    extras: Dict[str, Any] = dict(kl_loss_fn="none", kl_loss_fn_args={}, entropy_loss_fn="none")
    extras.update(entropy_loss_fn_args={"entropy_coef": 0.0}, loss_agg_mode="token-mean")
    return AlgorithmConfig(policy_loss_fn=name, policy_loss_fn_args=dict(args), **extras)


def all_variants() -> List[Variant]:
    """The six variants, in the order the tables list them (the last: paper defaults per update)."""
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    authors = dict(search_order="lower_first", positive_contribution_target=0.5)
    authors.update(ratio_lower_max=0.8, ratio_lower_step=0.05, ratio_upper_max=2.0)
    fixed = dict(ratio_lower_max=0.6, ratio_upper_max=1.2)
    bapo: List[Tuple[str, str, Dict]] = [
        ("bapo_fixed_start", "ablation: BAPO start pair fixed (0.6, 1.2)", fixed),
        ("bapo_paper", "BAPO, paper defaults", {}),
        ("bapo_authors", "BAPO, authors' settings", authors),
        ("bapo_update", "BAPO per update", {"search_scope": "update"}),
    ]
    ppo = dict(clip_range_low=0.2, clip_range_high=0.2)
    higher = dict(ppo, clip_range_high=0.28)
    rows = [("ppo", "PPO (0.8, 1.2)", "ppo", ppo, [0.8, 1.2])]
    rows.append(("ppo_clip_higher", "PPO clip-higher (0.8, 1.28)", "ppo", higher, [0.8, 1.28]))
    defaults = BAPOPolicyLossFn.default_args()
    rows += [(name, label, "bapo", {**defaults, **a}, [0.6, 1.2]) for name, label, a in bapo]
    return [Variant(*row) for row in rows]


def variant(name: str, **loss_overrides) -> Variant:
    """One variant by name, its loss arguments updated with ``loss_overrides``."""
    found = {v.name: v for v in all_variants()}[name]
    return found._replace(args={**found.args, **loss_overrides})
