"""Memory-lean functional ops (see issue 5: linear_cross_entropy)."""
