"""Stand-ins for what the tests and benchmarks need on a CPU-only machine and the package never ships (README.md)."""
