"""Models named by hub in VIT_MODELS (`timm:NAME`, `hf:REPO`), served offline from a local Hugging Face hub cache
the test makes (random weights, the hub's own layout: refs/main and a snapshot folder), converted once with the
parity check and kept in VIT_HUB_CACHE; a name that cannot be fetched or converted fails the start with one line."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from app.settings import BUNDLED_WEIGHTS
from harness.images import encode
from harness.preloaded import run_command
from harness.server import ROOT, Server, free_port
from model.shapes import make_sample
from tests.support.network import silent_endpoint

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
TIMM_NAME = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
HF_REPO = "someone/tiny-vit"
REFUSED_NAME = "vit_dwee_patch16_reg1_gap_256.sbb_in1k"  # differential attention: refused by name
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def snapshot(hub: Path, repo_id: str) -> Path:
    """The hub cache's folder for `repo_id` at COMMIT, with refs/main pointing at it, as huggingface_hub keeps it."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    folder = repo / "snapshots" / COMMIT
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A hub cache holding timm's TIMM_NAME and a small transformers ViT; timm's model is returned to compare with."""
    import timm
    from safetensors.torch import save_file
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    m = timm.create_model(TIMM_NAME.split(".")[0], pretrained=False).eval()
    torch.nn.init.normal_(m.head.weight, std=0.5)
    save_file(
        m.state_dict(), str(snapshot(root, timm.models.get_pretrained_cfg(TIMM_NAME).hf_hub_id) / "model.safetensors")
    )
    labels = {0: "a", 1: "b", 2: "c"}
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=3,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    ViTForImageClassification(config).save_pretrained(snapshot(root, HF_REPO))
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(snapshot(root, HF_REPO))
    refused = timm.create_model(REFUSED_NAME.split(".")[0], pretrained=False)  # a feature the converter lacks
    hub_id = timm.models.get_pretrained_cfg(REFUSED_NAME).hf_hub_id
    save_file(refused.state_dict(), str(snapshot(root, hub_id) / "model.safetensors"))
    return root, m


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())  # noqa: SIM118


def hub_env(root: Path, cache: Path, models: str) -> dict[str, str]:
    """Offline from the hub cache `root`, conversions kept in `cache`; no warm-up and the torch backend, which
    these starts do not test (the ONNX export of timm's model alone takes 7 s of a core here)."""
    hub = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root), "VIT_HUB_CACHE": str(cache)}
    return hub | {"VIT_MODELS": models, "VIT_WARMUP": "false", "VIT_BACKEND": "torch"}


def test_hub_names_serve_offline_converted_once(hub: tuple[Path, Any], tmp_path: Path) -> None:
    root, timm_model = hub
    cache = tmp_path / "converted"
    env = hub_env(root, cache, f"timm:{TIMM_NAME},tiny=hf:{HF_REPO}")
    photo = make_sample(3, 4).image.convert("RGB").resize((300, 200))
    png = encode(photo)
    with Server(BUNDLED_WEIGHTS, **env) as server:
        listed = httpx.get(f"{server.url}/v1/models").json()
        r = httpx.post(
            f"{server.url}/predict", files={"file": ("p.png", png, "image/png")}, params={"model": TIMM_NAME}
        )
        tiny = httpx.post(
            f"{server.url}/predict", files={"file": ("p.png", png, "image/png")}, params={"model": "tiny"}
        )
        first_log = server.stop()
    assert [m["name"] for m in listed["models"]] == [TIMM_NAME, "tiny"]
    assert r.status_code == 200 and tiny.status_code == 200, (r.text, tiny.text)
    from timm.data import create_transform, resolve_data_config

    with torch.inference_mode():
        pixels = create_transform(**resolve_data_config(model=timm_model))(Image.open(io.BytesIO(png)).convert("RGB"))
        expected = timm_model(pixels[None]).softmax(dim=-1)[0]
    torch.testing.assert_close(torch.tensor(r.json()["results"][0]["probabilities"]), expected, atol=1e-4, rtol=0)
    assert tiny.json()["results"][0]["top_k"][0]["label"] in ("a", "b", "c")
    kept = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*.safetensors"))
    assert kept == [f"hf/someone--tiny-vit@{COMMIT[:16]}.safetensors", f"timm/{TIMM_NAME}@{COMMIT[:16]}.safetensors"]
    assert first_log.count(" converted to ") == 2, first_log
    stamps = {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}

    with Server(BUNDLED_WEIGHTS, **env) as again:  # a restart converts nothing
        assert httpx.get(f"{again.url}/health/ready").status_code == 200
        second_log = again.stop()
    assert " converted to " not in second_log and second_log.count("converted before") == 2, second_log
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")} == stamps

    # a conversion kept from before the preprocessing check may carry guessed settings: it is made again
    older = cache / f"hf/someone--tiny-vit@{COMMIT[:16]}.safetensors"
    tensors, metadata = read_safetensors(older)
    training = json.loads(metadata["training"])
    del training["converted_from"]["preprocessing_check"]
    save_file(tensors, str(older), metadata=metadata | {"training": json.dumps(training)})
    with Server(BUNDLED_WEIGHTS, **env) as third:
        assert httpx.get(f"{third.url}/health/ready").status_code == 200
        third_start = third.stop()
    assert third_start.count(" converted to ") == 1 and "hf:someone/tiny-vit converted to" in third_start, third_start

    gone = {**env, "HF_HUB_CACHE": str(tmp_path / "empty-hub")}  # offline, and the hub's own cache lost
    with Server(BUNDLED_WEIGHTS, **gone) as kept:
        assert httpx.get(f"{kept.url}/v1/models").json()["default"] == TIMM_NAME
        third_log = kept.stop()
    assert third_log.count("cannot be fetched now; serving the conversion kept in") == 2, third_log


def test_without_a_hub_cache_the_conversion_goes_with_the_service(hub: tuple[Path, Any], tmp_path: Path) -> None:
    """VIT_HUB_CACHE empty keeps no conversion: the one made at the start lies in a folder of the service's own, in
    the temporary directory, while it serves, and is removed when it stops."""
    root, _ = hub
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = hub_env(root, tmp_path / "unused", f"tiny=hf:{HF_REPO}") | {"VIT_HUB_CACHE": "", "TMPDIR": str(scratch)}
    png = encode(make_sample(3, 4).image)
    with Server(BUNDLED_WEIGHTS, **env) as server:
        during = sorted(p.name for p in scratch.glob("vit-serve-hub-*/*.safetensors"))
        r = httpx.post(f"{server.url}/predict", files={"file": ("p.png", png, "image/png")}, params={"model": "tiny"})
        server.stop()
    assert r.status_code == 200, r.text
    assert during == ["someone--tiny-vit.safetensors"]
    assert list(scratch.glob("vit-serve-hub-*")) == []
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize(
    ("models", "message"),
    [
        (
            "x=timm:vit_small_patch16_224.augreg_in21k_ft_in1k",
            "VIT_MODELS x=timm:vit_small_patch16_224.augreg_in21k_ft_in1k: could not fetch",
        ),
        ("x=hf:nobody/nothing", "VIT_MODELS x=hf:nobody/nothing: could not fetch nobody/nothing"),
        ("x=timm:no_such_model", "timm has no model 'no_such_model'"),
        (
            f"x=timm:{REFUSED_NAME}",
            f"VIT_MODELS x=timm:{REFUSED_NAME}: unsupported feature: block 0: attention of type DiffAttention",
        ),
    ],
)
def test_a_hub_name_that_cannot_be_served_fails_the_start_with_one_line(
    hub: tuple[Path, Any], tmp_path: Path, models: str, message: str
) -> None:
    root, _ = hub
    env = {**hub_env(root, tmp_path / "converted", models), "VIT_WEIGHTS": str(BUNDLED_WEIGHTS), "VIT_DEVICE": "cpu"}
    done = run_command(
        [sys.executable, "-m", "app", "--port", str(free_port())],
        cwd=ROOT,
        env={**os.environ, **env, "VIT_GRPC_PORT": "0"},
        timeout=120,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    failures = [line for line in done.stderr.splitlines() if "startup failed" in line]
    assert len(failures) == 1 and message in failures[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_hub_that_does_not_answer_fails_the_start_at_once_with_one_line(tmp_path: Path) -> None:
    """Without HF_HUB_OFFLINE, on a network that drops packets: one probe of a few seconds, then the local hub cache
    alone (here empty), never the libraries' minute of retries and their lines."""
    env = {"VIT_MODELS": "x=hf:nobody/nothing", "HF_HUB_CACHE": str(tmp_path / "empty-hub"), "VIT_DEVICE": "cpu"}
    env |= {"VIT_HUB_CACHE": str(tmp_path / "converted"), "VIT_WEIGHTS": str(BUNDLED_WEIGHTS), "VIT_GRPC_PORT": "0"}
    base = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    with silent_endpoint() as endpoint:
        started = time.monotonic()
        done = run_command(
            [sys.executable, "-m", "app", "--port", str(free_port())],
            cwd=ROOT,
            env={**base, **env, "HF_ENDPOINT": endpoint},
            timeout=120,
        )
        took = time.monotonic() - started
    assert done.returncode == 3, done.stderr[-2000:]
    failures = [line for line in done.stderr.splitlines() if "startup failed" in line]
    expected = f"could not fetch nobody/nothing: {endpoint} did not answer within 3 s (ReadTimeout), and the local hub"
    assert len(failures) == 1 and expected in failures[0], done.stderr[-2000:]
    assert "Retry" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert took < 45, took  # the probe's 3 s and the start, not the retries' minute (or a hang, on this endpoint)


def runtime_set_only(folder: Path) -> dict[str, str]:
    """The environment of a process that can import only what requirements.lock installs (what bin/serve and the
    image have): a sitecustomize that hides every module of a dev-only distribution."""
    from importlib.metadata import packages_distributions

    def names(lock: str) -> set[str]:
        lines = (ROOT / lock).read_text().splitlines()
        return {line.split("==")[0].lower().replace("_", "-") for line in lines if "==" in line}

    # optree (DALI's) stays importable: torch imports it where its distribution's metadata says it is installed,
    # which hiding the module cannot change; without it installed, as in the runtime set, torch never imports it
    dev_only = names("requirements-dev.lock") - names("requirements.lock") - {"optree"}
    blocked = sorted(
        module
        for module, dists in packages_distributions().items()
        if all(d.lower().replace("_", "-") in dev_only for d in dists)
    )
    # None in sys.modules: an import fails and importlib.util.find_spec answers None, as for a package not installed
    (folder / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n")
    return {"PYTHONPATH": f"{folder}{os.pathsep}{ROOT}"}


def test_hub_names_serve_with_the_runtime_set_alone(hub: tuple[Path, Any], tmp_path: Path) -> None:
    """What bin/serve and the image install is enough to serve a hub name as the docs show it."""
    root, _ = hub
    only = runtime_set_only(tmp_path)
    refused = subprocess.run(
        [sys.executable, "-c", "import pytest"], env={**os.environ, **only}, capture_output=True, text=True
    )
    assert "ModuleNotFoundError: import of pytest halted" in refused.stderr  # the dev tools cannot be imported
    env = {**hub_env(root, tmp_path / "converted", f"timm:{TIMM_NAME},tiny=hf:{HF_REPO}"), **only}
    with Server(BUNDLED_WEIGHTS, **env) as server:
        listed = [m["name"] for m in httpx.get(f"{server.url}/v1/models").json()["models"]]
        log = server.stop()
    assert listed == [TIMM_NAME, "tiny"], log
