"""The table lookup that bins tokens must count exactly like a binary search."""

import pytest
import torch

from trinity.algorithm.policy_loss_fn.bapo_edges import MAX_CELLS, EdgeCounter


def _signed(lower, upper):
    return [-c for c in reversed(lower)] + [0.0] + upper


@pytest.mark.parametrize(
    "lower, upper, uses_table",
    [
        ([0.6 + 0.02 * k for k in range(16)], [1.2 + 0.05 * k for k in range(37)], True),  # paper
        ([0.8, 0.85, 0.9, 0.95], [1.2, 1.3, 1.4, 2.0], True),  # authors' run script, capped
        ([0.5], [1.0], True),  # point ranges
        ([0.5 + 0.001 * k for k in range(500)], [1.0 + 0.001 * k for k in range(1500)], True),
        ([0.6, 0.62, 0.6200001], [1.2, 1.25], False),  # tiny capped gap: binary search
    ],
)
def test_count_equals_searchsorted(lower, upper, uses_table):
    """Above all on the edges themselves and their float neighbours, where a rounding slip
    in the cell index would misplace a token."""
    edges = _signed(lower, upper)
    counter = EdgeCounter(edges)
    assert (counter.cells <= MAX_CELLS) == uses_table  # both paths are exercised
    e = torch.tensor(edges, dtype=torch.float64)
    planted = torch.cat([e, e.nextafter(e + 1), e.nextafter(e - 1), e.float().double()])
    spread = torch.linspace(-25.0, 25.0, 20001, dtype=torch.float64)
    extremes = torch.tensor([-4.9e8, -1e-300, -0.0, 0.0, 1e-300, 4.9e8], dtype=torch.float64)
    x = torch.cat([planted, spread, extremes, torch.randn(5000, dtype=torch.float64)])
    assert torch.equal(counter.count(x), torch.searchsorted(e, x, right=True))
