"""Strata engine service."""
