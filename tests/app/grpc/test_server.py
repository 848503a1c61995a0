"""The gRPC edge in process, over a real channel: the core's answers, limits, keys, deadlines and drain."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import torch

from app.codecs.proto import messages_pb2 as pb
from app.core.contract.request import EncodedImage, InferOptions
from harness.images import encode
from model.shapes import make_sample
from tests.app.grpc.conftest import Edge, EdgeFactory
from tests.support.checkpoints import write_broken_checkpoints
from tests.support.clients import slow_forward, until
from tests.support.grpc_requests import expect, image_request, probabilities

PNGS = [encode(make_sample(5, i).image) for i in range(3)]


async def test_health_and_metadata(edge: Edge) -> None:
    assert (await edge.stub.ServerLive(pb.ServerLiveRequest())).live
    assert (await edge.stub.ServerReady(pb.ServerReadyRequest())).ready
    model = edge.service.model("tiny")
    assert (await edge.stub.ModelReady(pb.ModelReadyRequest(name="tiny"))).ready
    assert (await edge.stub.ModelReady(pb.ModelReadyRequest(name="tiny", version=model.version))).ready
    assert not (await edge.stub.ModelReady(pb.ModelReadyRequest(name="tiny", version="0"))).ready
    assert not (await edge.stub.ModelReady(pb.ModelReadyRequest(name="nope"))).ready
    server = await edge.stub.ServerMetadata(pb.ServerMetadataRequest())
    assert server.name == "vit-serve" and "model_repository" in server.extensions
    meta = await edge.stub.ModelMetadata(pb.ModelMetadataRequest(name="tiny"))
    assert list(meta.versions) == [model.version] and meta.platform == "pytorch"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("image", "BYTES", [-1, 1]),
        ("pixels", "FP32", [-1, 3, 32, 32]),
    ]
    await expect(
        edge.stub.ModelMetadata(pb.ModelMetadataRequest(name="nope")),
        grpc.StatusCode.NOT_FOUND,
        "no model named 'nope'",
    )


async def test_infer_answers_what_the_core_answers(edge: Edge) -> None:
    model = edge.service.model("tiny")
    expected = await edge.service.lane.run(model, [EncodedImage(f"{i}", p) for i, p in enumerate(PNGS)], InferOptions())
    want = torch.stack([p.probabilities for p in expected.predictions]).numpy()
    for raw in (True, False):  # raw_input_contents as tritonclient sends, or typed bytes_contents
        response = await edge.stub.ModelInfer(image_request(*PNGS, raw=raw))
        assert response.model_name == "tiny" and response.model_version == model.version
        np.testing.assert_allclose(probabilities(response), want, atol=1e-6)
    pixels = torch.stack([model.preparer.prepare(EncodedImage("p", p), keep_image=False).pixels for p in PNGS]).numpy()
    for raw in (True, False):
        request = pb.ModelInferRequest(model_name="tiny", id="px")
        tensor = request.inputs.add(name="pixels", datatype="FP32", shape=list(pixels.shape))
        if raw:
            request.raw_input_contents.append(pixels.astype("<f4").tobytes())
        else:
            tensor.contents.fp32_contents.extend(pixels.flatten().tolist())
        response = await edge.stub.ModelInfer(request)
        assert response.id == "px"
        np.testing.assert_allclose(probabilities(response), want, atol=1e-6)


async def test_outputs_parameters_and_classification(edge: Edge) -> None:
    request = image_request(*PNGS[:2], attention="rollout", embedding=True, normalize=True)
    request.outputs.add(name="probabilities").parameters["classification"].int64_param = 2
    request.outputs.add(name="attention")
    request.outputs.add(name="embedding")
    response = await edge.stub.ModelInfer(request)
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("probabilities", "BYTES", [2, 2]),
        ("attention", "FP32", [2, 4, 4]),
        ("embedding", "FP32", [2, 32]),
    ]
    raw = response.raw_output_contents[0]
    first = raw[4 : 4 + int.from_bytes(raw[:4], "little")].decode()
    score, index, label = first.split(":")
    assert 0 < float(score) <= 1 and edge.service.model("tiny").classes[int(index)] == label
    maps = np.frombuffer(response.raw_output_contents[1], "<f4").reshape(2, 4, 4)
    assert maps.min() >= 0 and np.isclose(maps.max(), 1)
    embedding = np.frombuffer(response.raw_output_contents[2], "<f4").reshape(2, 32)
    np.testing.assert_allclose(np.linalg.norm(embedding, axis=1), 1, atol=1e-5)


async def test_api_keys_guard_inference_and_model_changes(make_edge: EdgeFactory) -> None:
    async with make_edge(api_keys="k1,k2") as edge:
        refused = await expect(edge.stub.ModelInfer(image_request(PNGS[0])), grpc.StatusCode.UNAUTHENTICATED, "API key")
        # how gRPC carries a key, not HTTP's header
        assert refused.details() == (
            "missing or invalid API key; send it in the x-api-key metadata, or as authorization: Bearer KEY"
        )
        await expect(
            edge.stub.ModelInfer(image_request(PNGS[0]), metadata=(("x-api-key", "wrong"),)),
            grpc.StatusCode.UNAUTHENTICATED,
            "API key",
        )
        assert await edge.stub.ModelInfer(image_request(PNGS[0]), metadata=(("x-api-key", "k2"),))
        assert await edge.stub.ModelInfer(image_request(PNGS[0]), metadata=(("authorization", "Bearer k1"),))
        load = pb.RepositoryModelLoadRequest(model_name="tiny")
        await expect(edge.stub.RepositoryModelLoad(load), grpc.StatusCode.UNAUTHENTICATED, "API key")
        assert (await edge.stub.ServerReady(pb.ServerReadyRequest())).ready  # health needs no key
        assert await edge.stub.ModelStatistics(pb.ModelStatisticsRequest())  # neither do statistics, as over REST


async def test_overload_is_unavailable_with_when_to_retry(make_edge: EdgeFactory) -> None:
    async with make_edge(max_files=4, max_queue=4) as edge:
        model = edge.service.model("tiny")
        under_way = slow_forward(model, 0.5)
        four = image_request(*PNGS, PNGS[0])
        computing = asyncio.ensure_future(edge.stub.ModelInfer(four))
        await until(under_way.is_set)
        queued = asyncio.ensure_future(edge.stub.ModelInfer(four))  # fills the queue while the first computes
        await until(lambda: model.batcher.queue_depth == 4)
        error = await expect(edge.stub.ModelInfer(image_request(PNGS[0])), grpc.StatusCode.UNAVAILABLE, "overloaded")
        assert "(retry after " in (error.details() or "")
        assert dict(error.trailing_metadata() or ())["retry-after"].isdigit()
        assert len((await computing).outputs) == len((await queued).outputs) == 1


async def test_deadlines(make_edge: EdgeFactory) -> None:
    async with make_edge(request_timeout_s=0.2) as edge:
        slow_forward(edge.service.model("tiny"), 0.5)
        await expect(
            edge.stub.ModelInfer(image_request(PNGS[0])), grpc.StatusCode.DEADLINE_EXCEEDED, "VIT_REQUEST_TIMEOUT_S"
        )
    async with make_edge() as edge:
        slow_forward(edge.service.model("tiny"), 0.5)
        await expect(edge.stub.ModelInfer(image_request(PNGS[0]), timeout=0.2), grpc.StatusCode.DEADLINE_EXCEEDED, "")
        assert len((await edge.stub.ModelInfer(image_request(PNGS[0]))).outputs) == 1  # still serving


async def test_messages_over_the_limit_are_resource_exhausted(make_edge: EdgeFactory) -> None:
    async with make_edge(grpc_max_message_bytes=2000) as edge:
        big = image_request(b"x" * 4000)
        await expect(edge.stub.ModelInfer(big), grpc.StatusCode.RESOURCE_EXHAUSTED, "")
        assert await edge.stub.ServerLive(pb.ServerLiveRequest())


async def test_requests_are_counted_with_their_protocol(edge: Edge) -> None:
    await edge.stub.ModelInfer(image_request(PNGS[0]))
    await expect(edge.stub.ModelInfer(image_request(PNGS[0], model="nope")), grpc.StatusCode.NOT_FOUND, "nope")
    text = edge.service.metrics.render().decode()
    assert 'vit_requests_total{protocol="grpc",route="ModelInfer",status="OK"} 1.0' in text
    assert 'vit_requests_total{protocol="grpc",route="ModelInfer",status="NOT_FOUND"} 1.0' in text
    assert 'vit_request_latency_seconds_count{protocol="grpc",route="ModelInfer"} 2.0' in text
    assert 'vit_requests_in_flight{protocol="grpc",route="ModelInfer"} 0.0' in text  # both answered


async def test_stopping_answers_the_calls_under_way(edge: Edge) -> None:
    computing = slow_forward(edge.service.model("tiny"), 0.5)
    under_way = asyncio.ensure_future(edge.stub.ModelInfer(image_request(PNGS[0])))
    await until(computing.is_set)
    await edge.server.stop(5)
    assert len((await under_way).outputs) == 1
    await expect(edge.stub.ModelInfer(image_request(PNGS[0])), grpc.StatusCode.UNAVAILABLE, "")


async def test_a_file_that_fails_to_load_is_named_never_placed(make_edge: EdgeFactory, tmp_path: Path) -> None:
    """As over REST: the load's answer and the index name the model's file and what is wrong with it, not its path."""
    broken = write_broken_checkpoints(tmp_path)
    async with make_edge(model_repository=tmp_path, model_control="explicit") as edge:
        for name, what in broken.items():
            load = pb.RepositoryModelLoadRequest(model_name=name)
            failed = await expect(
                edge.stub.RepositoryModelLoad(load),
                grpc.StatusCode.INVALID_ARGUMENT,
                f"failed to load {name}.safetensors: ",
            )
            assert what in (failed.details() or "") and "/" not in (failed.details() or ""), failed.details()
        index = await edge.stub.RepositoryIndex(pb.RepositoryIndexRequest())
    reasons = {m.name: m.reason for m in index.models if m.name in broken}
    assert all(what in reasons[name] and "/" not in reasons[name] for name, what in broken.items()), reasons


async def test_system_shared_memory_is_listed_where_clients_may_register(make_edge: EdgeFactory) -> None:
    for regions in (0, 4):
        async with make_edge(shared_memory_regions=regions) as edge:
            server = await edge.stub.ServerMetadata(pb.ServerMetadataRequest())
        assert ("system_shared_memory" in server.extensions) == (regions > 0)
