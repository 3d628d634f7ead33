"""``kvtier replay``: a request trace through a simulated engine over the real tier stack."""
