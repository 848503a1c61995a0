"""The service and every peer server a user would pick instead (LitServe, mosec, Triton, MLServer, TorchServe, BentoML, Ray Serve, KServe), on the same work in alternated rounds: req/s, latency, batches and CPU per request.

Each peer is configured as its own docs advise and installed into an environment of its own (`bench.peers.venvs`).
"""
