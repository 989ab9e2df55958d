"""Strata's services: engine (runtime), gateway/scheduler/scaler (infrastructure), control (tooling)."""
