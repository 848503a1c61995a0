"""deploy/ray, checked offline: the RayJob's fields against those KubeRay documents (ray.io/v1), its pod
templates against the Kubernetes Pod schema (strict), and its image, command and versions against the
Dockerfile's `ray` target, the batch runner's command line and the locked Ray."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import ray
import yaml

from app.batch.__main__ import parse_args

ROOT = Path(__file__).resolve().parent.parent
RAYJOB = ROOT / "deploy" / "ray" / "rayjob.yaml"
# The fields of KubeRay's ray.io/v1 API reference that this manifest may use (unknown ones fail).
RAYJOB_SPEC = {
    "entrypoint",
    "submissionMode",
    "shutdownAfterJobFinishes",
    "ttlSecondsAfterFinished",
    "activeDeadlineSeconds",
    "runtimeEnvYAML",
    "rayClusterSpec",
    "clusterSelector",
    "suspend",
    "entrypointNumCpus",
    "entrypointNumGpus",
    "submitterPodTemplate",
    "submitterConfig",
    "jobId",
    "metadata",
    "entrypointResources",
    "managedBy",
    "deletionStrategy",
    "backoffLimit",
}
CLUSTER_SPEC = {
    "rayVersion",
    "headGroupSpec",
    "workerGroupSpecs",
    "enableInTreeAutoscaling",
    "autoscalerOptions",
    "headServiceAnnotations",
    "suspend",
    "managedBy",
    "gcsFaultToleranceOptions",
}
HEAD_GROUP = {"rayStartParams", "template", "serviceType", "headService", "enableIngress"}
WORKER_GROUP = {
    "groupName",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "rayStartParams",
    "template",
    "numOfHosts",
    "scaleStrategy",
    "suspend",
    "idleTimeoutSeconds",
}


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(RAYJOB.read_text())
    return data


def pod_templates(job: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = job["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]


def test_the_rayjob_uses_only_documented_fields(job: dict[str, Any]) -> None:
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert set(spec) <= RAYJOB_SPEC and {"entrypoint", "rayClusterSpec"} <= set(spec)
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
    cluster = spec["rayClusterSpec"]
    assert set(cluster) <= CLUSTER_SPEC and set(cluster["headGroupSpec"]) <= HEAD_GROUP
    for group in cluster["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for params in [
        cluster["headGroupSpec"]["rayStartParams"],
        *(g["rayStartParams"] for g in cluster["workerGroupSpecs"]),
    ]:
        assert all(isinstance(v, str) for v in params.values())  # KubeRay wants strings


@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.latest_version()])
def test_pod_templates_are_valid_pods(job: dict[str, Any], version: str) -> None:
    for template in pod_templates(job):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ray"}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, version, strict=True)


def test_image_versions_and_command_match_the_repository(job: dict[str, Any]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM \S+ AS ray$", dockerfile, re.MULTILINE), "the Dockerfile has a ray target"
    user = int(re.findall(r"useradd .*--uid (\d+)", dockerfile)[0])
    locked = re.search(r"^ray==(\S+)$", (ROOT / "requirements-ray.lock").read_text(), re.MULTILINE)
    assert locked and job["spec"]["rayClusterSpec"]["rayVersion"] == locked.group(1) == ray.__version__
    images = set()
    for template in pod_templates(job):
        spec = template["spec"]
        assert spec["securityContext"]["runAsUser"] == user
        (container,) = spec["containers"]
        images.add(container["image"])
        assert {m["mountPath"] for m in container["volumeMounts"]} == {"/data"}
    assert len(images) == 1 and "vit-serve-ray" in images.pop()
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = sum(
        g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for g in workers
    )
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "app.batch"]
    args = parse_args(argv[3:])  # the runner's own parser accepts the command
    assert args.ray and args.ray_address == "auto" and args.actors <= gpus
    assert all(i.startswith("/data/") for i in args.inputs) and str(args.output).startswith("/data/")
    assert str(args.checkpoint) == "/srv/weights/vit-shapes.safetensors"  # WORKDIR /srv + COPY weights/
    assert "COPY weights/ weights/" in dockerfile and "WORKDIR /srv" in dockerfile
