"""Benchmarks behind ``kvtier bench``: each measures kvtier and a baseline in the same run."""
