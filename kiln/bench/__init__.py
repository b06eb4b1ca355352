"""``kiln bench``: throughput, latency and serving benchmarks, and their distance to the
device's limits (see benchmarks/README.md)."""
