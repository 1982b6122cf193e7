"""Helpers for ``scripts/bapo_experiment.py``: a multi-seed study of BAPO on stale data.

``task`` makes prompts and scores responses (failures run to the length limit), ``policy``
builds and samples the tiny language model, ``variants`` names the clipping schemes compared,
``trainer`` trains one (variant, seed, staleness) run through Trinity's engine loss, and
``report`` turns the runs' metrics into the table, the figure and the final JSON line.
"""
