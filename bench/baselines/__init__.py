"""Baselines a user of this library would otherwise run, as JAX programs for
the bench sweep (registered in `bench.registry`)."""
