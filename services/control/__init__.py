"""Tooling layer: deployments and revisions, the `strata` CLI, the dashboard."""
