"""Tests of the engine: request processing, detokenization and outputs."""
