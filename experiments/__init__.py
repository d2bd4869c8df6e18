"""Runnable experiments: the walkthrough (README.md, "The walkthrough"), benchmarks and the device check."""
