"""The forward step: the predictor (torch, CUDA graphs on a GPU) and the ONNX Runtime graph; the only code
that touches the device."""
