"""BAPO on a CUDA device: same decisions as on the CPU, and no hidden host syncs in the search.

Skipped where no CUDA device exists (CI has none); run on a GPU machine with the same command.
"""

import warnings

import pytest
import torch

from scripts.harness.cases import bench_batch, search_inputs
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SETTINGS = [
    dict(search_order=order, contribution=contribution, positive_contribution_target=target)
    for order in ("upper_first", "lower_first")
    for contribution in ("surrogate", "gradient")
    for target in (0.3, 0.45, 1.0)
]


def _batch(seed, device):
    batch = bench_batch((16, 256), seed, negative_share=0.6, device=device)
    batch["logprob"].requires_grad_(True)
    return batch


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_cuda_decision_loss_and_gradient_match_cpu(kwargs):
    fn = BAPOPolicyLossFn(**kwargs)
    results = {}
    for device in ("cpu", "cuda"):
        batch = _batch(0, device)
        loss, metrics = fn(**batch)
        loss.backward()
        results[device] = (loss.detach().cpu(), metrics, batch["logprob"].grad.cpu())
    (cpu_loss, cpu_metrics, cpu_grad), (gpu_loss, gpu_metrics, gpu_grad) = results.values()
    for key in ("bapo_clip_low", "bapo_clip_high", "bapo_search_steps", "bapo_target_met"):
        assert gpu_metrics[key] == cpu_metrics[key], key
    # float32 exp differs by an ulp between the two devices, so rho agrees to float32 precision
    assert gpu_metrics["bapo_positive_contribution"] == pytest.approx(
        cpu_metrics["bapo_positive_contribution"], rel=1e-6
    )
    assert torch.allclose(gpu_loss, cpu_loss, rtol=1e-5, atol=1e-7)
    assert torch.allclose(gpu_grad, cpu_grad, rtol=1e-5, atol=1e-9)


def _syncs(call):
    """Number of synchronising CUDA operations that ``call`` makes."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("contribution", ["surrogate", "gradient"])
def test_search_syncs_the_host_once(contribution):
    """The sums stay on the device; the walk copies them to the host once."""
    fn = BAPOPolicyLossFn(contribution=contribution)
    batch = _batch(1, "cuda")
    args = search_inputs(batch)
    fn.search.local_sums(*args)  # first call copies the small candidate grids to the device
    sums, in_sums = _syncs(lambda: fn.search.local_sums(*args))
    _, in_walk = _syncs(lambda: fn.search.decide(sums))
    assert (in_sums, in_walk) == (0, 1)
