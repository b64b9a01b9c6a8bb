"""Training a model: the loop, the optimiser, validation, the end of training, resumable run state, the lock, metrics."""
