"""Schemathesis against the service's own OpenAPI schema, over the network: no 5xx, no schema violations."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def live_server(serve: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> str:
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("schema") / "tiny.safetensors")
    return serve(checkpoint, VIT_MAX_WAIT_MS="0").url


def test_api_conforms_to_its_schema(live_server: str) -> None:
    """Every operation, with generated valid and invalid inputs: no 5xx, responses match the schema."""
    schema = schemathesis.openapi.from_url(f"{live_server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {"POST /predict", "GET /v1/model"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def conforms(case: schemathesis.Case) -> None:
            # "Schema-valid" bytes are not a decodable image (no JSON schema can say "a valid PNG"),
            # so a 415/422 for them is right; every other check applies.
            case.call_and_validate(excluded_checks=[positive_data_acceptance])

        conforms()
