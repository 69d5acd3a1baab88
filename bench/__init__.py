"""Benchmarks of the optimizer on the local control plane (see bench/README.md)."""
