"""Loaded by every Python process of the Ray that ``make trinity-run`` starts (its PYTHONPATH).

Trinity's ``load_plugins()`` never runs in verl's worker processes, so a plugin cannot carry the
CPU stand-ins there; Python's ``sitecustomize`` hook can. Inert unless the launcher turned it on.
"""

from scripts.harness.cpu import install_from_env

install_from_env()
