"""Strata gateway service."""
