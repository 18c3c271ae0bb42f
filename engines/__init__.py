"""unispec engines: ONNX artifact -> TensorRT engine."""
