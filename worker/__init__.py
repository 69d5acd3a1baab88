"""Composition root: configuration, CLI, wiring, watcher and Temporal worker start-up."""
