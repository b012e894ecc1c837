"""The PyTorch serving engine: model execution, sampling and stop handling for real requests."""
