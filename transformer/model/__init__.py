"""The paper's model: the encoder-decoder Transformer, its positions, its decoding cache, and checkpoints of its weights."""
