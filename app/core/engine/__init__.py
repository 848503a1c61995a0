"""The engine: the served models (loaded, replaced, unloaded), the repository they come from, the response
cache, and the compute step that runs a request through them in this process."""
