"""Strata scheduler service."""
