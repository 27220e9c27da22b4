"""Tests of the model implementations against Hugging Face transformers."""
