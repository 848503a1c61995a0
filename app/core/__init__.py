"""The serving core: what an image goes through, from encoded file to prediction, with no web framework.

contract (what the edges import) -> front (the data plane) -> engine (the models, the cache) -> batcher
-> images (decode, preprocess) -> backends (torch or ONNX Runtime)

The core imports `model`, `app.choices`, `app.settings` and `app.telemetry`, never a codec, an edge,
grpcio or a web framework (tests/app/test_layers.py checks that).
"""
