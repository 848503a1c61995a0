"""A checkpoint's version as the service names it, from its content hash; imports nothing, so the service's
light modules may use it."""


def numeric_version(content_hash: str) -> str:
    """A checkpoint's version as the service gives it on every protocol: the first 48 bits of its content hash,
    in decimal. A number, as Triton's versions are (its tools parse them as integers), and the same wherever
    the same weights serve: every replica, every restart (a count in load order would differ between replicas
    that loaded models in another order). 48 bits fit a JSON number exactly."""
    return str(int(content_hash[:12], 16))
