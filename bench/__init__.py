"""Benchmarks run by ``make bench``; their tables go in the README."""
