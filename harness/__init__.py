"""What the tests and the benchmarks share: servers as real processes, generated images, load with `hey`,
the benchmark checkpoints and the model-change experiments. `tests/` and `bench/` import this, never each other."""
