"""Settings: validation at startup, the model list, and VIT_ variables that set nothing."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import AUTO_WORKERS_ON_GPU, HubName, Settings, available_cpus, configured_names, unknown_variables
from app.startup import read_settings


def test_one_model_is_named_by_its_file() -> None:
    assert Settings(weights=Path("runs/mine.safetensors")).model_paths() == {"mine": Path("runs/mine.safetensors")}


def test_several_models_in_order() -> None:
    paths = Settings(models=" a=x.safetensors , b = y.safetensors").model_paths()
    assert list(paths.items()) == [("a", Path("x.safetensors")), ("b", Path("y.safetensors"))]
    assert Settings(models="  ").models is None  # compose passes VIT_MODELS= when unset


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"models": "a=x,a=y"}, "VIT_MODELS names 'a' twice"),
        ({"models": "just-a-path"}, "is not name=path"),
        ({"device": "gpu"}, "VIT_DEVICE must be auto, cpu, cuda or cuda:N"),
        ({"max_queue": 4, "max_files": 8}, r"VIT_MAX_QUEUE \(4\) must be at least VIT_MAX_FILES \(8\)"),
        ({"max_batch_size": 0}, "greater than or equal to 1"),
        ({"hw_decoder_load": 0}, "greater than 0"),
        ({"hw_decoder_load": 1.5}, "less than or equal to 1"),
        ({"cpu_decode_share": -0.1}, "VIT_CPU_DECODE_SHARE must be auto or a share from 0 to 1, got -0.1"),
        ({"cpu_decode_share": "1.5"}, "VIT_CPU_DECODE_SHARE must be auto or a share from 0 to 1, got '1.5'"),
        ({"cpu_decode_share": "half"}, "VIT_CPU_DECODE_SHARE must be auto or a share from 0 to 1, got 'half'"),
        ({"cpu_decode_share_start": 2}, "less than or equal to 1"),
        ({"api_keys": " , ,"}, "VIT_API_KEYS holds no key, only commas"),  # else the service would be open
    ],
)
def test_bad_values_are_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**values)  # type: ignore[arg-type]


def test_api_keys_empty_are_off_and_listed_are_each_a_key() -> None:
    assert Settings(api_keys="").api_key_set() == frozenset()  # compose passes VIT_API_KEYS= when unset
    assert Settings(api_keys=" k1 ,, k2 ").api_key_set() == {"k1", "k2"}


def test_a_typo_names_the_closest_setting() -> None:
    assert unknown_variables({"VIT_MAX_BATCHSIZE", "VIT_DEVICE", "PATH"}) == [
        "VIT_MAX_BATCHSIZE is not a setting and is ignored; did you mean VIT_MAX_BATCH_SIZE?"
    ]
    [far] = unknown_variables({"VIT_ZZZ"})
    assert far.startswith("VIT_ZZZ is not a setting and is ignored; the settings are VIT_API_KEYS, ")


def test_compose_and_kubernetes_variables_are_left_alone() -> None:
    injected = {
        "VIT_SERVE_SERVICE_HOST",
        "VIT_SERVE_SERVICE_PORT",
        "VIT_SERVE_SERVICE_PORT_HTTP",
        "VIT_SERVE_PORT",
        "VIT_SERVE_PORT_80_TCP",
        "VIT_SERVE_PORT_80_TCP_ADDR",
        "VIT_PORT",
        "VIT_MODELS_DIR",
    }
    assert unknown_variables(injected) == []


def test_names_come_from_the_environment_and_the_env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".env").write_text("VIT_TREADS=2\n")
    monkeypatch.setenv("VIT_WARMPU", "false")
    names = configured_names(tmp_path / ".env")
    assert {"VIT_TREADS", "VIT_WARMPU"} <= names


def test_startup_logs_unknown_variables(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VIT_WEIGHTS", str(tiny_checkpoint))
    monkeypatch.setenv("VIT_DEVICE", "cpu")
    monkeypatch.setenv("VIT_BACKEND", "torch")
    monkeypatch.setenv("VIT_MAX_BATCHSIZE", "8")
    logger = logging.getLogger("app")
    logger.addHandler(caplog.handler)
    try:
        read_settings()  # what `python -m app` and `uvicorn app.main:app` start with
    finally:
        logger.removeHandler(caplog.handler)
    assert "VIT_MAX_BATCHSIZE is not a setting and is ignored; did you mean VIT_MAX_BATCH_SIZE?" in caplog.text


def test_workers_is_auto_a_number_or_refused() -> None:
    assert Settings().workers == "auto"
    assert Settings(workers="3").serving_workers(gpu=False) == 3
    assert Settings(workers="auto").serving_workers(gpu=False) == 1  # no GPU: one process, as before
    assert 2 <= Settings(workers="auto").serving_workers(gpu=True) <= AUTO_WORKERS_ON_GPU
    for bad in ("0", "-1", "two", "65"):
        with pytest.raises(ValidationError, match="VIT_WORKERS must be auto or a number"):
            Settings(workers=bad)


def test_the_cores_available_follow_a_containers_cpu_limit(tmp_path: Path) -> None:
    limit = tmp_path / "cpu.max"
    limit.write_text("250000 100000\n")  # 2.5 cores
    assert available_cpus(limit) == min(3, len(os.sched_getaffinity(0)))
    limit.write_text("max 100000\n")
    assert available_cpus(limit) == len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path / "none") == len(os.sched_getaffinity(0))


def test_models_may_be_named_by_hub() -> None:
    paths = Settings(
        models="timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k, d=hf:facebook/deit-tiny-patch16-224, f=/w/f.safetensors"
    ).model_paths()
    assert paths == {
        "vit_tiny_patch16_224.augreg_in21k_ft_in1k": HubName("timm", "vit_tiny_patch16_224.augreg_in21k_ft_in1k"),
        "d": HubName("hf", "facebook/deit-tiny-patch16-224"),
        "f": Path("/w/f.safetensors"),
    }
    assert str(paths["d"]) == "hf:facebook/deit-tiny-patch16-224"
    assert HubName.parse("hf:org/some-repo").default_name() == "some-repo"  # type: ignore[union-attr]
    assert HubName.parse("s3:bucket/x") is None and HubName.parse("timm:") is None
    with pytest.raises(ValueError, match="names 'deit-tiny-patch16-224' twice"):
        Settings(models="hf:a/deit-tiny-patch16-224,hf:b/deit-tiny-patch16-224").model_paths()


@pytest.mark.parametrize(
    ("values", "line"),
    [
        (
            {"max_queue": 4},
            "invalid settings: VIT_MAX_QUEUE (4) must be at least VIT_MAX_FILES (16), or a full-size request could "
            "never be accepted",
        ),
        ({"max_queue": "x"}, "invalid settings: VIT_MAX_QUEUE: Input should be a valid integer"),
        ({"shadow": "a"}, "invalid settings: VIT_SHADOW: 'a' is not champion:challenger"),
    ],
)
def test_a_settings_error_reads_as_one_plain_line(values: dict[str, object], line: str) -> None:
    from pydantic import ValidationError

    from app.startup import describe_startup_error

    with pytest.raises(ValidationError) as raised:
        Settings(**values)  # type: ignore[arg-type]
    said = describe_startup_error(raised.value)
    assert said.startswith(line) and "VIT_:" not in said and "Value error" not in said, said
