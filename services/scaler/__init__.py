"""Strata scaler service."""
