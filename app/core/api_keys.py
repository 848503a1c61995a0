"""API keys (VIT_API_KEYS): checked the same way whichever edge a request came through."""

from __future__ import annotations

import hmac

from app.core.errors import Unauthorized


class ApiKeys:
    def __init__(self, keys: frozenset[str]) -> None:
        self.keys = keys

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def check(self, given: str) -> None:
        """Raise Unauthorized unless keys are off or `given` is one of them."""
        if not self.keys:
            return
        # compare with every key, in constant time, so timing reveals neither key nor position
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(given.encode(), key.encode())
        if not matched:
            raise Unauthorized("missing or invalid API key; send it in the X-API-Key header")
