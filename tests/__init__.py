"""The project's tests; the launched checks run on every rank as ``python -m tests.<module>``."""
