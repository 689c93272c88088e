"""Fixtures for testbed tests."""
