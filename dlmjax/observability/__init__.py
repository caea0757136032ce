"""Where a run's metrics go besides metrics.jsonl: TensorBoard event files, Weights & Biases."""
