"""Support shared by the tests and the benchmarks (random-weight models); imports torch."""
