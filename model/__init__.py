"""Vision Transformer classifier, its datasets, training and evaluation, and the checkpoint format."""
