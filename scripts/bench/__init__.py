"""Helpers for ``scripts/bapo_bench.py``: inputs, the authors'-style literal search, the
machine header, the torchrun worker (``dp_worker``) and the peak-memory probe (``rss_probe``).
"""
