"""``kvtier plan``: hit ratio against cache size, per policy, from a request trace."""
