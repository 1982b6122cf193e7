"""Trinity's policy loss as the demo and the experiment call it, with what they check around it.

``loss_config`` is the loss alone (no KL, no entropy bonus); ``GroupSpy`` shows that the
data-parallel group reaches the policy loss through the patched ``TrinityPolicyLoss``;
``surrogate_sums`` recomputes Eq. 8's P and N apart from the loss, as a cross-check.
"""

import torch


def loss_config(name: str, args: dict):
    """Trinity's AlgorithmConfig for policy loss ``name`` with ``args``, nothing else in it."""
    from trinity.common.config import AlgorithmConfig

    return AlgorithmConfig(
        policy_loss_fn=name,
        policy_loss_fn_args=args,
        kl_loss_fn="none",
        kl_loss_fn_args={},
        entropy_loss_fn="none",
        entropy_loss_fn_args={"entropy_coef": 0.0},
        loss_agg_mode="token-mean",
    )


class GroupSpy:
    """Stands in for the loss's policy_loss_fn and records which dp_group reached it.

    Proves that the group arrives through the patched TrinityPolicyLoss rather than being
    dropped (the released one drops it); every other attribute is the real loss function's.
    """

    def __init__(self, inner, expected_group):
        """Wrap ``inner``; count calls that receive ``expected_group``."""
        self._inner, self._expected = inner, expected_group
        self.calls = self.forwarded = 0

    def __getattr__(self, name):
        """Everything else (``select_keys`` and the like) is the real loss's."""
        return getattr(self._inner, name)

    def __call__(self, *args, **kwargs):
        """Count the call and whether the group arrived, then run the real loss."""
        self.calls += 1
        self.forwarded += int(kwargs.get("dp_group", None) is self._expected)
        return self._inner(*args, **kwargs)


def surrogate_sums(ratio, adv, mask, low, high):
    """Eq. 8's P and N at one pair, written independently of the code under test."""
    ratio, adv, mask = ratio.double(), adv.double(), mask.bool()
    pos = (adv > 0) & mask
    neg = (adv < 0) & mask
    p = (adv * torch.clamp(ratio, max=high))[pos].sum().item()
    n = (-adv * torch.clamp(ratio, min=low))[neg].sum().item()
    return p, n
