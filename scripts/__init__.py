"""The project's scripts (demo, experiment, bench, the wheel, pull requests) and their harness."""
