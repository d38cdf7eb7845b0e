"""Builds the repository: PyTorch networks, their ONNX export and the generated config.pbtxt files."""
