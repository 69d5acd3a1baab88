"""The self-hosted hub: clusters, tokens, policies, approvals, action reports, audit log."""
