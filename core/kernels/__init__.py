"""Kernel interfaces with plain-torch reference implementations (the CPU path and the test oracle)."""
