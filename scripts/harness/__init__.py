"""What the scripts and the tests share (imported as ``scripts.harness`` from the repo root).

The tiny model, the tasks, batches, the loss recorder, the torchrun launcher, verl's engine on
CPU, the one trainer and the torchrun workers.
"""
