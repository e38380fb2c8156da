"""Launch plans, the attestation sidecar and contract, and host deployment (docs/deployment.md)."""
