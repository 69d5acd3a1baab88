"""The local clouds: Compute Engine and Azure Resource Manager servers, moto, and what tests and `make dev` do
with them (see tests/harness/README.md)."""
