"""Every failure the core raises has an entry in every protocol's status table: none falls through to 500 or INTERNAL."""

from __future__ import annotations

import inspect

import pytest

import app.core.contract.errors as errors
from app.grpc.server import STATUS as GRPC_STATUS
from app.web.errors import PREDICT_STATUS, V2_STATUS

TABLES = {"/predict": PREDICT_STATUS, "V2 REST": V2_STATUS, "gRPC": GRPC_STATUS}


def failure_kinds(module: object = errors) -> set[type[errors.ServiceError]]:
    """The concrete failures: subclasses of ServiceError defined in the module (the base is no failure itself)."""
    return {
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, errors.ServiceError) and c is not errors.ServiceError
    }


@pytest.mark.parametrize("protocol", TABLES)
def test_every_core_error_has_a_status(protocol: str) -> None:
    missing = failure_kinds() - set(TABLES[protocol])
    assert not missing, f"{protocol} has no status for {sorted(k.__name__ for k in missing)}"


def test_the_check_fails_for_a_new_error() -> None:
    """A failure added to the core without a status would be caught."""

    class Sideways(errors.ServiceError):
        """A failure no table knows."""

    class Module:
        pass

    Module.Sideways = Sideways  # type: ignore[attr-defined]
    Module.NotReady = errors.NotReady  # type: ignore[attr-defined]
    assert failure_kinds(Module) - set(PREDICT_STATUS) == {Sideways}
