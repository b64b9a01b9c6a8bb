"""Text to training batches: raw corpora, the vocabulary, the prepared store, batching and the Batch."""
