"""One-off comparisons: a change measured against an older checkout, or one cost measured alone, each behind a
figure in the docs. The standing benchmarks, rerun as the code changes, are the modules of `bench` itself."""
