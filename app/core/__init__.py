"""The serving core: what an image goes through, from encoded file to prediction, with no web framework.

decode -> preprocess -> DynamicBatcher -> Predictor (torch or ONNX Runtime) -> Prediction

`Service.infer` is the one entry every edge calls. The core imports `model` and `app.settings`,
never `app.codecs` or `app.web` (a test checks that no web framework gets imported with it).
"""
