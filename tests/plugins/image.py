"""Fixtures for image tests."""
