"""``kvtier plan``: hit ratio against cache size, per policy, from a request trace, with the
bounds (Belady, the reuse oracle, oracle disk admission) that say what is left to gain."""
