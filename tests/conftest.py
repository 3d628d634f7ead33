"""Fixtures shared by the whole suite live here; helpers are the ``kvtier_testing`` package."""
