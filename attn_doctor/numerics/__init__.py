"""The exact float64 attention reference, the error of a tensor against it, and the seeded inputs of each
input distribution."""
