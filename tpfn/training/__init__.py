"""Training with a parallelized model: loss parallel, gradient clipping, checkpoints."""
