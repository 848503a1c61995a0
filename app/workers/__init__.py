"""The serving processes (VIT_WORKERS > 1): the supervisor, the engine process and the front-ends forked
beside it, the messages between them over ZeroMQ, and the shared memory that carries images and outputs."""
