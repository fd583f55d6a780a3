"""Benchmarks behind ``ftharness bench``; each prints a JSON object as its last line."""
