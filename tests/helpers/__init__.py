"""Helpers only the tests use (kept out of the runtime packages)."""
