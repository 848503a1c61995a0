"""Turn one uploaded image file into what a model's batch takes: decoded, checked and preprocessed pixels, or
a plain JPEG whose header passed the checks when the model decodes those on the GPU.

The engine prepares the files it is handed; with VIT_WORKERS > 1 each serving front-end prepares its own
requests' files, on its own cores, and hands the engine `DecodedImage`s. Both run this one preparer, built
from what a model version prescribes, so the pixels are the same wherever they were made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import cast

from opentelemetry import context as otel_context
from opentelemetry.util.types import AttributeValue
from PIL import Image
from torch import Tensor

from app.core.contract.request import DecodedImage, EncodedImage
from app.core.images.decode import load_image, open_image
from app.core.images.gpu_decode import Jpeg, gpu_decodable
from app.core.images.jpeg_markers import plain_jpeg
from app.telemetry.spans import child_span
from model.preprocessing import EvalTransform, Preprocessing


class Preprocessor:
    """Resize per the checkpoint's policy, scale to [0, 1], normalise -> (C, S, S) float32.

    It is the evaluation transform the model was scored with, so served and measured accuracy agree. For a model
    on a GPU it stops at the resized (C, S, S) uint8 pixels (`pixels`): the device scales and normalises them with
    their batch (`Predictor`), a quarter of the bytes to move and no float work on the host.
    """

    def __init__(self, p: Preprocessing) -> None:
        self.preprocessing = p
        self.transform = EvalTransform(p)

    def __call__(self, image: Image.Image) -> Tensor:
        x: Tensor = self.transform(image)
        return x

    def pixels(self, image: Image.Image) -> Tensor:
        """Resized and cropped, not yet scaled: (C, S, S) uint8."""
        return self.transform.pixels(image)


@dataclass(frozen=True)
class Prepared:
    filename: str
    image: Image.Image | None  # kept only when an overlay is drawn
    # (C, S, S) float32 normalised, or uint8 for a device that normalises (`uint8`); a plain JPEG stays encoded
    # when the GPU decodes it
    pixels: Tensor | Jpeg


class ImagePreparer:
    """One model version's way from a file to its input: decode (a large JPEG scaled inside libjpeg when
    `jpeg_draft`), check, preprocess; a plain JPEG is only checked when `gpu_jpegs` (nvJPEG decodes it), except
    for `cpu_share` of them, every file in turn, which are decoded here too (VIT_CPU_DECODE_SHARE: a number, or
    the share the engine's `DecodeShare` chose, set as it moves). With `uint8` (a model on a GPU), pixels stop
    before scaling: the device normalises them with their batch."""

    def __init__(
        self,
        preprocessing: Preprocessing,
        max_pixels: int,
        jpeg_draft: bool,
        gpu_jpegs: bool,
        cpu_share: float = 0.0,
        uint8: bool = False,
    ) -> None:
        self.preprocessor = Preprocessor(preprocessing)
        self.channels = preprocessing.channels
        self.max_pixels = max_pixels
        self.draft_to = preprocessing.resize_size if jpeg_draft else None
        self.gpu_jpegs = gpu_jpegs
        self.cpu_share = cpu_share
        self.uint8 = uint8
        self.cpu_credit = 0.0  # the share owed to the CPU so far: a file goes there each time it reaches 1

    def prepare(self, image: EncodedImage | DecodedImage, keep_image: bool, leave_jpeg: bool = True) -> Prepared:
        """Decode, validate and preprocess one image file (CPU work: run it on a pool thread); a `DecodedImage`
        again from its file. A JPEG the GPU decodes stays encoded unless `leave_jpeg` is false."""
        header = open_image(image.data, image.filename, self.max_pixels)
        if self.gpu_jpegs and leave_jpeg and not keep_image and gpu_decodable(header, image.data):
            return Prepared(image.filename, None, Jpeg(image.data, image.filename))
        # An overlay is drawn on the image as sent: decoded in full.
        draft_to = None if keep_image else self.draft_to
        decoded = load_image(header, image.filename, self.channels, draft_to)
        pixels = self.preprocessor.pixels(decoded) if self.uint8 else self.preprocessor(decoded)
        return Prepared(image.filename, decoded if keep_image else None, pixels)

    async def prepare_all(
        self, images: Sequence[EncodedImage | DecodedImage], keep_images: bool, pool: Executor
    ) -> list[Prepared]:
        """Every file prepared, each in a `decode` span under the caller's span: a plain JPEG that the GPU decodes
        is told from its markers here, on the caller's thread (`plain_jpeg`: a few microseconds, less than the
        hand-off to a pool thread); every other file, and the plain JPEGs of the CPU's share, on `pool`, all at
        once."""
        prepared: list[Prepared | None] = [None] * len(images)
        leave = [True] * len(images)  # false: decoded on the pool even if the GPU could
        if self.gpu_jpegs and not keep_images:
            for k, image in enumerate(images):
                if plain_jpeg(image.data, self.max_pixels):
                    if self.decode_here():
                        leave[k] = False
                    else:
                        prepared[k] = self.left_encoded(image)
        rest = [k for k, p in enumerate(prepared) if p is None]
        if not rest:
            return cast(list[Prepared], prepared)
        loop = asyncio.get_running_loop()
        context = otel_context.get_current()
        done = iter(
            await asyncio.gather(
                *(
                    loop.run_in_executor(pool, self.prepare_traced, context, images[k], keep_images, leave[k])
                    for k in rest
                )
            )
        )
        return [p if p is not None else next(done) for p in prepared]

    def left_encoded(self, image: EncodedImage | DecodedImage) -> Prepared:
        """A plain JPEG (its markers said so), left encoded for the GPU, in its `decode` span: opened once the
        markers are read, so that a file has one whichever way it goes; it leaves out their few microseconds."""
        with child_span("decode", {"vit.image.filename": image.filename, "vit.image.bytes": len(image.data)}):
            return Prepared(image.filename, None, Jpeg(image.data, image.filename))

    def set_cpu_share(self, share: float) -> None:
        """The share of plain JPEGs decoded here from now on (the engine's `DecodeShare` moved it)."""
        self.cpu_share = share

    def decode_here(self) -> bool:
        """Whether this plain JPEG is the CPU's turn: `cpu_share` of them, spread evenly over the files."""
        self.cpu_credit += self.cpu_share
        if self.cpu_credit < 1.0:
            return False
        self.cpu_credit -= 1.0
        return True

    def prepare_traced(
        self,
        context: otel_context.Context,
        image: EncodedImage | DecodedImage,
        keep_image: bool,
        leave_jpeg: bool = True,
    ) -> Prepared:
        """`prepare` in a `decode` span under `context` (it runs on a pool thread, outside the request's)."""
        attributes: dict[str, AttributeValue] = {
            "vit.image.filename": image.filename,
            "vit.image.bytes": len(image.data),
        }
        with child_span("decode", attributes, context):
            return self.prepare(image, keep_image, leave_jpeg)
