"""Deterministic orchestration. Imports no cloud SDK, Kubernetes client or network library (import-linter)."""
