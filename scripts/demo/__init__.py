"""Helpers for ``scripts/bapo_demo.py``: a small multi-rank PPO-vs-BAPO run on CPU.

``task`` makes prompts and scores responses, ``policy`` builds and samples the tiny language
model, ``batch`` lays a rollout out as Trinity's trainer hands it to the actor, ``engine`` builds
verl's FSDP training engine on CPU, ``loss`` configures Trinity's loss and checks what reaches
it, ``worker`` is the torchrun entry point, and ``report`` turns the logged metrics into a
figure and a summary. ``scripts/bapo_experiment.py`` reuses the task, model and loss helpers.
"""
