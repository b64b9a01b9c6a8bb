"""transformer: train, run and score encoder-decoder Transformer translation models from YAML configs."""

__version__ = "0.1.0"
