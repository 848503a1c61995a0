"""deploy/k8s and deploy/kserve, checked offline: every manifest against the Kubernetes API schemas
(kubernetes-validate, strict: unknown fields fail), the KServe resources against KServe's own API models,
and both against the image and the app they run (ports, user, probe paths, drain time, model name)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from app.settings import AUTO_WORKERS_ON_GPU, BUNDLED_WEIGHTS, Settings
from app.web.app import create_app
from tests.support.api_models import api_models
from tests.support.data_planes import UnreadyDataPlane

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "deploy" / "k8s" / "base"
CPU = ROOT / "deploy" / "k8s" / "overlays" / "cpu"
KSERVE = ROOT / "deploy" / "kserve"
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]  # the oldest supported release and the newest
DOCKER_USER = int(re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))  # type: ignore[union-attr]
DOCKER_PORT = int(re.search(r"^EXPOSE (\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE).group(1))  # type: ignore[union-attr]
APP_PATHS = set(create_app(UnreadyDataPlane()).openapi()["paths"])


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def base_resources() -> dict[str, dict[str, Any]]:
    """The base's resources by kind, as kustomize would collect them."""
    kustomization = load(BASE / "kustomization.yaml")
    docs = [load(BASE / name) for name in kustomization["resources"]]
    return {doc["kind"]: doc for doc in docs}


def render_cpu_deployment() -> dict[str, Any]:
    """The CPU overlay's Deployment: the base with the overlay's JSON 6902 patch applied, as kustomize does."""
    overlay = load(CPU / "kustomization.yaml")
    assert overlay["resources"] == ["../../base"]
    (patch,) = overlay["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "vit-serve"}
    result: dict[str, Any] = jsonpatch.apply_patch(base_resources()["Deployment"], load(CPU / patch["path"]))
    return result


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c  # type: ignore[no-any-return]


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_kubernetes(version: str) -> None:
    resources = [*base_resources().values(), render_cpu_deployment()]
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)


def test_kustomization_lists_every_base_file() -> None:
    listed = set(load(BASE / "kustomization.yaml")["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(base_resources()) == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"}


def test_invalid_manifests_are_caught() -> None:
    """The validation can fail: a misspelt field and a wrong type are rejected."""
    deployment = base_resources()["Deployment"]
    broken = jsonpatch.apply_patch(deployment, [{"op": "add", "path": "/spec/replica", "value": 2}])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)
    broken = jsonpatch.apply_patch(deployment, [{"op": "replace", "path": "/spec/replicas", "value": "two"}])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_deployment_matches_the_image_and_the_app() -> None:
    r = base_resources()
    deployment, service = r["Deployment"], r["Service"]
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    grpc_port = Settings.model_fields["grpc_port"].default
    assert c["ports"] == [
        {"name": "http", "containerPort": DOCKER_PORT, "protocol": "TCP"},
        {"name": "grpc", "containerPort": grpc_port, "protocol": "TCP"},
    ]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] in APP_PATHS, probe
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert c["command"] == ["python", "-m", "app", "--host", "0.0.0.0", "--port", str(DOCKER_PORT)]
    # drain: the preStop pause plus the drain timeout fit in the grace period
    pause = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = float(env_of(c)["VIT_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] > pause + drain
    # non-root, read-only root filesystem with a writable /tmp
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == DOCKER_USER
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert {v["name"] for v in pod["volumes"]} == {"tmp", "shm"}
    # the front-ends' shared-memory arenas (VIT_WORKERS > 1), in memory, where the processes look for them
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    [shm] = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    # one GPU per pod, with requests and limits; cores for auto's front-ends and the engine's two
    resources = c["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
    assert env_of(c)["VIT_WORKERS"] == "auto"
    assert int(resources["requests"]["cpu"]) >= AUTO_WORKERS_ON_GPU + 2
    # every selector finds the pods
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert r["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [(p["name"], p["targetPort"]) for p in service["spec"]["ports"]] == [("http", "http"), ("grpc", "grpc")]
    assert service["spec"]["ports"][1]["appProtocol"] == "kubernetes.io/h2c"
    target = r["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert r["PodDisruptionBudget"]["spec"]["minAvailable"] < r["HorizontalPodAutoscaler"]["spec"]["minReplicas"]
    assert all(Settings.model_fields.get(k.removeprefix("VIT_").lower()) for k in env_of(c) if k.startswith("VIT_"))


def test_cpu_overlay_drops_the_gpu() -> None:
    deployment = render_cpu_deployment()
    c = container(deployment)
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert "tolerations" not in deployment["spec"]["template"]["spec"]
    assert env_of(c)["VIT_DEVICE"] == "cpu"
    assert int(env_of(c)["VIT_THREADS"]) == int(c["resources"]["requests"]["cpu"])
    Settings(device=env_of(c)["VIT_DEVICE"], threads=int(env_of(c)["VIT_THREADS"]))  # values the service accepts


def model_fields(type_name: str) -> dict[str, str]:
    """A KServe or Kubernetes API model's fields by their JSON names, with their OpenAPI types."""
    fields = api_models().get(type_name)
    assert fields is not None, f"no API model {type_name}"
    return fields


def check_against_models(value: Any, type_name: str, where: str = "") -> None:
    """Every field known to the API model (by its JSON name), every value of the declared type, recursively."""
    # kserve writes list[X] and dict(str, X); the kubernetes client writes List[X] and Dict[str, X]
    if type_name.lower().startswith("list["):
        assert isinstance(value, list), f"{where}: expected a list"
        for i, item in enumerate(value):
            check_against_models(item, type_name[5:-1], f"{where}[{i}]")
        return
    if type_name.lower().startswith(("dict(", "dict[")):
        assert isinstance(value, dict), f"{where}: expected a mapping"
        inner = type_name[5:-1].split(", ", 1)[1]
        for key, item in value.items():
            check_against_models(item, inner, f"{where}.{key}")
        return
    primitives: dict[str, Any] = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if type_name in primitives:
        assert isinstance(value, primitives[type_name]), f"{where}: expected {type_name}, got {value!r}"
        return
    if type_name == "ResourceQuantity":  # kserve's alias of Kubernetes' quantity
        assert isinstance(value, str | int), where
        return
    fields = model_fields(type_name)
    assert isinstance(value, dict), f"{where}: expected an object ({type_name})"
    for key, item in value.items():
        assert key in fields, f"{where}: {type_name} has no field {key!r}"
        check_against_models(item, fields[key], f"{where}.{key}")


@pytest.mark.slow  # kserve's API models, read in a process of their own
@pytest.mark.parametrize(
    ("name", "type_name"),
    [
        ("servingruntime.yaml", "V1alpha1ServingRuntime"),
        ("inferenceservice.yaml", "V1beta1InferenceService"),
        ("inferenceservice-grpc.yaml", "V1beta1InferenceService"),
    ],
)
def test_kserve_resources_match_kserves_api_models(name: str, type_name: str) -> None:
    check_against_models(load(KSERVE / name), type_name, name)


def test_the_model_check_can_fail() -> None:
    isvc = load(KSERVE / "inferenceservice.yaml")
    isvc["spec"]["predictor"]["model"]["protocol"] = "v2"  # the field is protocolVersion
    with pytest.raises(AssertionError, match="has no field 'protocol'"):
        check_against_models(isvc, "V1beta1InferenceService")


def test_inference_service_runs_our_image_over_v2() -> None:
    runtime, isvc = load(KSERVE / "servingruntime.yaml"), load(KSERVE / "inferenceservice.yaml")
    model = isvc["spec"]["predictor"]["model"]
    assert model["protocolVersion"] == "v2" and "v2" in runtime["spec"]["protocolVersions"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    (c,) = runtime["spec"]["containers"]
    assert c["image"].split(":")[0] == "vit-serve" and c["ports"][0]["containerPort"] == DOCKER_PORT
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready" in APP_PATHS
    assert c["securityContext"]["runAsUser"] == DOCKER_USER
    # clients call /v2/models/<InferenceService name>/infer: the bundled model answers to that name
    assert isvc["metadata"]["name"] == BUNDLED_WEIGHTS.stem


def test_grpc_inference_service_routes_grpc_to_the_services_grpc_port() -> None:
    runtime, isvc = load(KSERVE / "servingruntime.yaml"), load(KSERVE / "inferenceservice-grpc.yaml")
    model = isvc["spec"]["predictor"]["model"]
    assert model["protocolVersion"] == "grpc-v2" in runtime["spec"]["protocolVersions"]
    assert model["runtime"] == runtime["metadata"]["name"]
    # KServe sends gRPC (HTTP/2 cleartext) to the container port named h2c: the service's gRPC port
    assert model["ports"] == [
        {"name": "h2c", "containerPort": Settings.model_fields["grpc_port"].default, "protocol": "TCP"}
    ]
    # the model answers to the InferenceService's name, as a client of /v2/models/<name> expects
    name, path = env_of(model)["VIT_MODELS"].split("=")
    assert name == isvc["metadata"]["name"] and path == "/srv/weights/" + BUNDLED_WEIGHTS.name
    Settings(models=env_of(model)["VIT_MODELS"])
