"""Helpers for ``scripts/bapo_bench.py``.

Inputs, the per-candidate literal search, the machine header, the CUDA part, the torchrun
worker (``dp_worker``) and the peak-memory probe (``rss_probe``).
"""
