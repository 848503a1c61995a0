"""The peer servers the benchmarks compare the service with, each configured as its own docs advise."""
