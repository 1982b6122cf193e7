"""BAPO on a CUDA device: the same decisions as on the CPU, and one host sync in the search.

Skipped where no CUDA device exists (CI has none); run on a GPU machine with the same command.
"""

import warnings

import pytest
import torch

from scripts.harness.cases import bench_batch, product_search
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def inputs(device, dtype=torch.float32):
    """A (16, 256) batch, 60% negative, with a leaf log-prob on ``device``.

    The harness's batch builder, since the GPU bundle carries scripts/ but not tests/.
    """
    batch = bench_batch((16, 256), seed=0, negative_share=0.6, device=device)
    logprob, old, mask, adv = (
        batch[k] for k in ("logprob", "old_logprob", "action_mask", "advantages")
    )
    return logprob.to(dtype).requires_grad_(True), old.to(dtype), mask, adv.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", [0.3, 0.4, 1.0])  # start, mid-path, whole grid
@pytest.mark.parametrize("order", ["upper_first", "lower_first"])
def test_cuda_decision_loss_and_gradient_match_cpu(order, target, dtype):
    fn = BAPOPolicyLossFn(search_order=order, positive_contribution_target=target)
    results = []
    for device in ("cpu", "cuda"):
        logprob, old, mask, adv = inputs(device, dtype)
        loss, metrics = fn(logprob=logprob, old_logprob=old, action_mask=mask, advantages=adv)
        loss.backward()
        results.append((loss.detach().cpu().float(), metrics, logprob.grad.cpu().float()))
    (cpu_loss, cpu_m, cpu_grad), (gpu_loss, gpu_m, gpu_grad) = results
    for key in ("bapo_clip_low", "bapo_clip_high", "bapo_search_steps", "bapo_target_met"):
        assert gpu_m[key] == cpu_m[key], key
    # exp differs by an ulp between the two devices, so rho agrees to the dtype's precision
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    rho = cpu_m["bapo_positive_contribution"]
    assert gpu_m["bapo_positive_contribution"] == pytest.approx(rho, rel=tolerance)
    torch.testing.assert_close(gpu_loss, cpu_loss, rtol=tolerance, atol=1e-7)
    torch.testing.assert_close(gpu_grad, cpu_grad, rtol=tolerance, atol=1e-6)


def syncs(call) -> int:
    """The number of synchronising CUDA operations in ``call()``."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_the_search_syncs_the_host_once_and_the_call_once_more_than_ppo():
    """Eq. 8's sums stay on the device until ``sums.tolist()``, the search's one host sync.

    ``_prepare`` rounds the bounds to the ratio's dtype on the host (its ``.tolist()`` waits on
    nothing) and copies them to the device with ``non_blocking=True`` (a blocking copy would
    synchronise); the rest of a call syncs where PPO's does, in the ``.item()`` of the four
    metrics both report.
    """
    bapo, ppo = BAPOPolicyLossFn(), PPOPolicyLossFn(clip_range=0.2)
    batch = dict(zip(("logprob", "old_logprob", "action_mask", "advantages"), inputs("cuda")))
    for loss in (bapo, ppo):  # warm-up: the first call creates the cuBLAS handle
        loss(**batch)
    counts = [syncs(lambda: bapo._prepare(**batch)), syncs(lambda: product_search(bapo, batch))]
    counts.append(syncs(lambda: bapo(**batch)) - syncs(lambda: ppo(**batch)))
    assert counts == [0, 1, 1]
