"""FastAPI service that serves a ViT checkpoint with dynamic batching."""
