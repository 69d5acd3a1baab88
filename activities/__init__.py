"""Side effects: Kubernetes, clouds, pricing, hub, gateway, audit. Each activity is idempotent."""
