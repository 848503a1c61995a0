"""Serving benchmark: the hardware limit, the service under load, and a peer, measured in one run."""
