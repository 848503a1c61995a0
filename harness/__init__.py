"""What the tests, the benchmarks and the evaluations share: servers as real processes, generated images, load
with `hey`, the benchmark checkpoints, the model-change experiments and the record every result carries.
`tests/`, `bench/` and `evaluation/` import this, never each other."""
