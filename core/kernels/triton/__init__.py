"""Triton implementations of the core kernel interfaces (CUDA); references live one level up."""
