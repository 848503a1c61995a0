from __future__ import annotations

import pytest

from app.core.api_keys import ApiKeys
from app.core.errors import Unauthorized


def test_no_keys_means_open() -> None:
    keys = ApiKeys(frozenset())
    assert not keys.required
    keys.check("")


def test_only_a_configured_key_passes() -> None:
    keys = ApiKeys(frozenset({"alpha", "beta"}))
    assert keys.required
    keys.check("beta")
    for wrong in ("", "alph", "alpha ", "gamma"):
        with pytest.raises(Unauthorized, match="missing or invalid API key"):
            keys.check(wrong)
