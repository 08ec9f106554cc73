"""Speculative decoding: draft tokens from a model's draft head (MTP), verified in one forward."""
