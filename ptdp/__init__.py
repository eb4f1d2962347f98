"""ptdp: PTD-P (tensor, pipeline and data parallel) training of GPT models in plain PyTorch."""

__version__ = "0.1.0"
