"""The core's failures are plain exceptions: a message saying what to fix, no protocol status."""

from __future__ import annotations

import inspect

import app.core.contract.errors as errors


def failure_kinds() -> list[type[errors.ServiceError]]:
    """Every failure the core raises: the subclasses of ServiceError in app.core.contract.errors."""
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.ServiceError)]


def test_every_failure_kind_is_a_service_error_without_a_status() -> None:
    kinds = failure_kinds()
    assert errors.ServiceError in kinds and errors.NotReady in kinds
    for kind in kinds:
        e = kind("what to fix")
        assert str(e) == e.detail == "what to fix"
        assert not any(hasattr(e, a) for a in ("status", "status_code", "code"))


def test_overloaded_says_when_to_retry() -> None:
    assert errors.Overloaded("full", retry_after_s=3).retry_after_s == 3
