from __future__ import annotations

import pytest

from app.core.contract.errors import Unauthorized
from app.core.data_plane import ApiKeys


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
