"""Attention kernels written for the tests: correct ones, subtly wrong ones, and ones that crash or hang."""
