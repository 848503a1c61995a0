"""Helpers shared by the tests (and the benchmark's server launcher): import them from here, never from a test module."""
