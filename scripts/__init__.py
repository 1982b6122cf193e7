"""The project's scripts (demo, experiment, bench, pull requests, patch tool) and their harness."""
