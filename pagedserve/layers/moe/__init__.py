"""Mixture-of-experts layers (issue 23): routing, the fused expert computation and its torch
reference."""
