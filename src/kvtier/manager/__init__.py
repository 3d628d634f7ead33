"""OffloadingManagers: the scheduler side of kvtier."""
