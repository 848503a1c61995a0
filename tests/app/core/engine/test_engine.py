"""The engine, the in-process data plane, used with no edge: images or pixels in, predictions out."""

from __future__ import annotations

import pytest
import torch

from app.core.contract.errors import Draining, InvalidInput, ModelNotFound, NotReady, UnsupportedMediaType
from app.core.contract.inference import Inference, InferenceRequest
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions
from app.core.engine.engine import Engine
from harness.images import encode
from model.shapes import make_sample


def images(n: int) -> list[EncodedImage]:
    return [EncodedImage(f"{i}.png", encode(make_sample(7, i).image)) for i in range(n)]


async def test_images_and_their_pixels_give_the_same_predictions(service: Engine) -> None:
    model = service.model(None)
    files = images(3)
    from_files = (await service.lane.run(model, files, InferOptions("rollout"))).predictions
    pixels = torch.stack([model.preparer.prepare(f, keep_image=False).pixels for f in files])
    from_pixels = (await service.lane.run(model, pixels, InferOptions("rollout"))).predictions
    assert [p.filename for p in from_files] == ["0.png", "1.png", "2.png"]
    assert [p.filename for p in from_pixels] == ["pixels[0]", "pixels[1]", "pixels[2]"]
    for a, b in zip(from_files, from_pixels, strict=True):
        torch.testing.assert_close(a.probabilities, b.probabilities)
        torch.testing.assert_close(a.attention_map, b.attention_map)
        assert a.overlay_png is None


async def test_images_a_front_end_decoded_are_batched_as_they_are_for_their_version(service: Engine) -> None:
    """A front-end's pixels go to the batch untouched while the version they were made for serves; made for
    another version (a reload came between), the engine decodes the file again for the one serving."""
    model = service.model(None)
    files = images(2)
    from_files = (await service.lane.run(model, files, InferOptions())).predictions
    blank = torch.zeros(model.input_shape)
    [from_blank] = (await service.lane.run(model, blank[None], InferOptions())).predictions
    decoded = [DecodedImage(f.filename, f.data, model.version, blank, 0.05) for f in files]
    stats = service.book.of(model.name, model.version)
    input_ns = stats.compute_input.ns
    for p in (await service.lane.run(model, decoded, InferOptions())).predictions:
        torch.testing.assert_close(p.probabilities, from_blank.probabilities)  # these pixels, not the file's
    assert stats.compute_input.ns - input_ns >= 50_000_000  # the front-end's decoding counts as input time
    stale = [DecodedImage(f.filename, f.data, "an-old-version", blank, 0.05) for f in files]
    # a file left for a GPU decoder this engine lacks: decoded here
    left_for_gpu = [DecodedImage(f.filename, f.data, model.version, None, 0.0) for f in files]
    for inputs in (stale, left_for_gpu):
        again = (await service.lane.run(model, inputs, InferOptions())).predictions
        assert [p.filename for p in again] == ["0.png", "1.png"]
        for a, b in zip(again, from_files, strict=True):
            torch.testing.assert_close(a.probabilities, b.probabilities)


async def test_overlays_are_drawn_for_files_only(service: Engine) -> None:
    model = service.model(None)
    [prediction] = (await service.lane.run(model, images(1), InferOptions("last", overlay=True))).predictions
    assert prediction.overlay_png is not None and prediction.overlay_png.startswith(b"\x89PNG")
    with pytest.raises(InvalidInput, match="send images, not pixels"):
        await service.lane.run(model, torch.zeros(1, *model.input_shape), InferOptions("last", overlay=True))


async def test_one_bad_file_fails_the_request_before_any_compute(service: Engine) -> None:
    model = service.model(None)
    batches_before = service.metrics.batch_size.labels(model.name)._sum.get()
    bad = [*images(2), EncodedImage("notes.txt", b"plain text")]
    with pytest.raises(UnsupportedMediaType, match="notes.txt: not a recognised image"):
        await service.lane.run(model, bad, InferOptions())
    await service.lane.run(model, images(1), InferOptions())  # queued after anything of the bad request's
    assert service.metrics.batch_size.labels(model.name)._sum.get() == batches_before + 1


async def test_an_unknown_target_names_the_classes(service: Engine) -> None:
    with pytest.raises(InvalidInput, match="target 'moon' names no class of model tiny"):
        await service.lane.run(service.model(None), images(1), InferOptions("gradient", "moon"))


async def test_models_by_name_and_version(service: Engine) -> None:
    model = service.model(None)
    assert service.model("tiny") is model and service.model("tiny", model.version) is model
    with pytest.raises(ModelNotFound, match="no model named 'other'; this service serves: tiny"):
        service.model("other")
    with pytest.raises(ModelNotFound, match=f"it serves version {model.version}"):
        service.model("tiny", "0")


async def test_readiness_follows_start_and_shutdown(service: Engine) -> None:
    service.check_serving()
    assert service.metrics.ready._value.get() == 1
    await service.shutdown()
    with pytest.raises(Draining, match="shutting down"):
        service.check_serving()
    with pytest.raises(NotReady, match="shutting down"):
        await service.lane.run(service.model(None), images(1), InferOptions())


async def test_costly_encoding_runs_off_the_event_loop(service: Engine) -> None:
    import threading

    loop_thread = threading.get_ident()

    def encoded_on(_: Inference) -> int:
        return threading.get_ident()

    plain = await service.infer(InferenceRequest(service.describe(None), images(1), InferOptions()), encoded_on)
    mapped = await service.infer(
        InferenceRequest(service.describe(None), images(1), InferOptions("rollout")), encoded_on
    )
    assert plain == loop_thread  # ten numbers: inline
    assert mapped != loop_thread  # a map: on the CPU pool
