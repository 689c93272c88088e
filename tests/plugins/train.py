"""Fixtures for train tests."""
