"""Tensor-parallel tests: sharded loading, TP=N vs TP=1 equality, faults, Ray."""
