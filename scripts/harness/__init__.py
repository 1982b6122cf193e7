"""What the scripts and the tests share, imported as ``scripts.harness`` from the repo root."""
