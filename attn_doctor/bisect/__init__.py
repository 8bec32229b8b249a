"""Bisection: the pure minimizer, the knobs it turns, the driver that probes real kernels, and the
standalone repro it writes."""
