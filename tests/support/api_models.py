"""The fields of KServe's and Kubernetes' API models, read in a process of their own.

Importing kserve registers the protobuf package `inference`, which tritonclient.grpc (used by the gRPC tests)
registers too, and one process can hold only one of them (see kserve_client.py).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

from harness.server import ROOT


@functools.cache
def api_models() -> dict[str, dict[str, str]]:
    """OpenAPI type name -> {JSON field name: the field's OpenAPI type}, KServe's before Kubernetes'."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.api_models"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    models: dict[str, dict[str, str]] = json.loads(done.stdout)
    return models


def dump() -> dict[str, dict[str, str]]:
    import kserve.models
    import kubernetes.client.models

    found: dict[str, dict[str, str]] = {}
    for module in (kserve.models, kubernetes.client.models):
        for name in dir(module):  # the kubernetes client's models load lazily, by attribute
            cls = getattr(module, name)
            if isinstance(cls, type) and hasattr(cls, "attribute_map") and hasattr(cls, "openapi_types"):
                fields = {json_name: cls.openapi_types[attr] for attr, json_name in cls.attribute_map.items()}
                found.setdefault(name, fields)
    return found


if __name__ == "__main__":
    print(json.dumps(dump()))
