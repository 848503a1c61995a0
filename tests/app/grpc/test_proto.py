"""The checked-in gRPC code is what bin/protos makes from the .proto files, and speaks Triton's wire format."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tritonclient.grpc import service_pb2 as triton

from app.codecs.proto import messages_pb2 as pb
from harness.server import ROOT

GENERATED = ["messages_pb2.py", "messages_pb2.pyi", "service_pb2_grpc.py"]


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(["bin/protos", str(tmp_path)], cwd=ROOT, check=True, env={**os.environ, "PYTHON": sys.executable})
    for name in GENERATED:
        made = (tmp_path / "app/codecs/proto" / name).read_text()
        assert made == (ROOT / "app/codecs/proto" / name).read_text(), f"{name} is stale: run bin/protos"
    assert sorted(p.name for p in (tmp_path / "app/codecs/proto").iterdir()) == sorted(GENERATED)


def test_messages_are_tritons_on_the_wire() -> None:
    """A request serialised with tritonclient's own messages parses here field for field, and back."""
    request = triton.ModelInferRequest(model_name="m", model_version="v", id="7", raw_input_contents=[b"\x01\x02"])
    request.parameters["attention"].string_param = "rollout"
    request.parameters["big"].uint64_param = 2**63
    tensor = request.inputs.add(name="pixels", datatype="FP32", shape=[1, 3, 4, 4])
    tensor.contents.fp32_contents.extend([0.5, 1.5])
    request.outputs.add(name="probabilities").parameters["classification"].int64_param = 3
    ours = pb.ModelInferRequest.FromString(request.SerializeToString())
    assert ours.parameters["attention"].string_param == "rollout" and ours.parameters["big"].uint64_param == 2**63
    assert list(ours.inputs[0].shape) == [1, 3, 4, 4] and list(ours.inputs[0].contents.fp32_contents) == [0.5, 1.5]
    assert ours.outputs[0].parameters["classification"].int64_param == 3
    assert triton.ModelInferRequest.FromString(ours.SerializeToString()) == request
    index = pb.RepositoryIndexResponse(
        models=[pb.RepositoryIndexResponse.ModelIndex(name="a", state="READY", reason="")]
    )
    assert triton.RepositoryIndexResponse.FromString(index.SerializeToString()).models[0].state == "READY"


def test_statistics_are_tritons_on_the_wire() -> None:
    duration = pb.StatisticDuration(count=3, ns=2**40)
    ours = pb.ModelStatisticsResponse(
        model_stats=[
            pb.ModelStatistics(
                name="m",
                version="v",
                last_inference=1,
                inference_count=6,
                execution_count=2,
                inference_stats=pb.InferStatistics(success=duration, queue=duration, cache_miss=duration),
                batch_stats=[pb.InferBatchStatistics(batch_size=4, compute_infer=duration)],
            )
        ]
    )
    [theirs] = triton.ModelStatisticsResponse.FromString(ours.SerializeToString()).model_stats
    assert (theirs.name, theirs.inference_count, theirs.execution_count) == ("m", 6, 2)
    assert theirs.inference_stats.cache_miss.ns == 2**40 and theirs.batch_stats[0].compute_infer.count == 3
