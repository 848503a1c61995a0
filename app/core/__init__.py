"""The serving core: what an image goes through, from encoded file to prediction, with no web framework.

decode -> preprocess -> DynamicBatcher -> Predictor (torch or ONNX Runtime) -> Prediction

`DataPlane` (data_plane.py) is everything an edge may call; `Engine` (engine.py) is the one in this
process. The core imports `model`, `app.choices` and `app.settings`, never a codec, an edge, grpcio
or a web framework (tests/app/test_layers.py checks that).
"""
