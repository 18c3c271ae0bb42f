"""unispec export: configs, checkpoint loading, torch models, speculative math, ONNX export."""
