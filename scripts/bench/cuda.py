"""The CUDA part of `make bench`: BAPO beside PPO where training runs, and beside a model step.

Figures (the ``cuda`` object of the bench's JSON line):

* ``bapo_over_ppo_fwd``: one BAPO forward over one PPO forward, per token count;
* ``bapo_over_ppo_fwd_bwd``: the same with the backward pass;
* ``search_ms``: ``local_sums`` + ``decide`` alone (paper grid, whole 51-step walk);
* ``step_overhead_share``: (BAPO forward and backward minus PPO's) over one training step
  (forward and backward) of a Qwen2-0.5B-shaped model built from its config: random weights,
  bfloat16, 8 x 2,048 tokens.

Every figure is a median of calls timed with CUDA events, BAPO and PPO interleaved. The same
code runs on CPU with tiny sizes (``perf_counter``), so the smoke test can exercise it.
"""

import statistics
import time
from typing import Any, Callable, Dict, List

import torch

from bench.inputs import PAPER, make_batch, ratio_of

# Qwen2-0.5B's shape (its config.json), so that no weights need to be downloaded.
QWEN2_0_5B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)
SIZES: Dict[str, Dict[str, Any]] = {
    "full": dict(
        fwd_tokens=[65_536, 8_388_608],
        fwd_bwd_tokens=[65_536],
        search_tokens=[65_536, 1_048_576, 8_388_608],
        repeats=50,
        model=QWEN2_0_5B,
        step_shape=(8, 2048),
        step_repeats=10,
    ),
    "quick": dict(
        fwd_tokens=[4096],
        fwd_bwd_tokens=[4096],
        search_tokens=[4096],
        repeats=3,
        model=dict(
            QWEN2_0_5B,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=256,
        ),
        step_shape=(2, 64),
        step_repeats=2,
    ),
}


def median_ms(fns: Dict[str, Callable], repeats: int, device: str, warmup: int = 3) -> Dict:
    """Interleaved calls of each function; {name: median milliseconds}."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_timed_ms(fn, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def _timed_ms(fn: Callable, device: str) -> float:
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def _losses():
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
    from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn

    return BAPOPolicyLossFn(**PAPER), PPOPolicyLossFn(clip_range=0.2)


def _shape(tokens: int):
    return (max(1, tokens // 1024), min(tokens, 1024))


def loss_ms(tokens: int, device: str, repeats: int, backward: bool) -> Dict[str, float]:
    """Median ms of one BAPO and one PPO call on the same micro-batch."""
    bapo, ppo = _losses()
    batch = make_batch(_shape(tokens), seed=0, device=device, requires_grad=True)

    def call(fn):
        batch["logprob"].grad = None
        loss, _ = fn(**batch)
        if backward:
            loss.backward()

    return median_ms({"bapo": lambda: call(bapo), "ppo": lambda: call(ppo)}, repeats, device)


def search_ms(tokens: int, device: str, repeats: int) -> float:
    """Return the median ms of local_sums + decide on the paper grid's whole walk."""
    bapo, _ = _losses()
    batch = make_batch(_shape(tokens), seed=0, device=device)
    ratio, finite = ratio_of(batch)
    adv, mask = batch["advantages"], batch["action_mask"]

    def search():
        return bapo.search.decide(bapo.search.local_sums(ratio, adv, mask, finite))

    assert search().steps == 51  # the timed walk is the whole paper path
    return median_ms({"search": search}, repeats, device)["search"]


def model_step_ms(config: Dict, shape, device: str, repeats: int) -> float:
    """Forward and backward of a causal LM built from ``config`` (bfloat16, random weights)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        Qwen2Config(**config), torch_dtype=torch.bfloat16, attn_implementation="sdpa"
    ).to(device)
    ids = torch.randint(0, config["vocab_size"], shape, device=device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return median_ms({"step": step}, repeats, device, warmup=2)["step"]


def run(device: str, size: str) -> Dict:
    """Every CUDA figure for one size ("full" or "quick"); printed lines go through ``say``."""
    sizes = SIZES[size]
    out: Dict = {"device": _device_name(device)}
    fwd = {n: loss_ms(n, device, sizes["repeats"], False) for n in sizes["fwd_tokens"]}
    both = {n: loss_ms(n, device, sizes["repeats"], True) for n in sizes["fwd_bwd_tokens"]}
    out["bapo_over_ppo_fwd"] = {n: t["bapo"] / t["ppo"] for n, t in fwd.items()}
    out["bapo_over_ppo_fwd_bwd"] = {n: t["bapo"] / t["ppo"] for n, t in both.items()}
    out["search_ms"] = {n: search_ms(n, device, sizes["repeats"]) for n in sizes["search_tokens"]}
    step_tokens = sizes["step_shape"][0] * sizes["step_shape"][1]
    step_losses = loss_ms(step_tokens, device, sizes["repeats"], True)
    step = model_step_ms(sizes["model"], sizes["step_shape"], device, sizes["step_repeats"])
    out["step_overhead_share"] = (step_losses["bapo"] - step_losses["ppo"]) / step
    out["ms"] = {"fwd": fwd, "fwd_bwd": both, "step_losses": step_losses, "model_step": step}
    return out


def _device_name(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{device} (torch {torch.__version__})"


def report(result: Dict) -> List[str]:
    """Readable lines for the bench's output."""
    lines = [f"## CUDA: {result['device']} (CUDA events, medians, BAPO and PPO interleaved)"]
    for key in ("bapo_over_ppo_fwd", "bapo_over_ppo_fwd_bwd", "search_ms"):
        for tokens, value in result[key].items():
            lines.append(f"   {key:24s} {tokens:>10,d} tokens  {value:8.3f}")
    ms = result["ms"]
    lines.append(
        f"   model step {ms['model_step']:.1f} ms; BAPO - PPO forward+backward at the same "
        f"tokens {ms['step_losses']['bapo'] - ms['step_losses']['ppo']:.3f} ms; "
        f"step_overhead_share {100 * result['step_overhead_share']:.3f}%"
    )
    return lines
