"""Dynamic batching: images from concurrent requests share one forward pass (`batcher.DynamicBatcher`)."""
