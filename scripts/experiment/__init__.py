"""Helpers for ``scripts/bapo_experiment.py``: a multi-seed study of BAPO on stale data.

``task`` sets the lengths and scores responses (failures run to the length limit), ``policy``
scores the tiny language model in verl's layout, ``variants`` names the clipping schemes
compared, ``trainer`` trains one (variant, seed, staleness) run through Trinity's engine loss,
and ``report`` turns the runs' metrics into the table, the figure and the final JSON line. The
prompt maker, the model, its sampler and the checks around the loss are the demo's (``demo``).
"""
