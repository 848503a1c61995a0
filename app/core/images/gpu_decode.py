"""JPEG decoding and preprocessing on the GPU, a batch at a time.

On a GPU host, decoding and resizing uploads on the CPU is what bounds the service: a core decodes,
resizes and normalises far fewer photos a second than the GPU computes. Plain JPEGs (baseline, RGB or
grayscale, upright, whole) are instead checked from their header on the CPU pool and decoded on
the forward thread with the batch they ride in: one decoder call for the batch, then the checkpoint's
own tensor transform (antialiased resize, crop, scale, normalise) on the device, images of one size
resized together. Every other image (PNG, progressive, CMYK, rotated by EXIF, overlays) is decoded
on the CPU as before, and a JPEG that the GPU rejects is decoded again by PIL, whose verdict
(pixels, or a 4xx for a broken file) is final.

Three decoders (`VIT_DECODE`):
- `auto`: torchvision's nvJPEG, the CUDA decoder, on the SMs (with the Huffman stage on CPU threads for
  images under a megapixel).
- `nvimgcodec`: nvImageCodec, with the GPU's hardware JPEG engines first (A100, H100, H200 and others carry
  them) and its CUDA decoder for what they leave (every file on a GPU without engines). Its pixels are
  nearer PIL's (its chroma upsampling is PIL's).
- `dali`: DALI's mixed decoder (the `[dali]` extra), the engines and the CUDA decoder behind DALI's own
  stream-ordered pools, as Triton's DALI backend decodes JPEGs (`DaliJpeg` on a CPU device is DALI's CPU
  decoder: what the tests run without a GPU).

Beside a forward that never pauses, the engines decoded a small share of their own rate on an H200, and the
service served less with them than with nvJPEG, so `auto` stays nvJPEG: docs/performance.md ("Which decoder
takes which image") gives the figures and what is measured next.
"""

from __future__ import annotations

import functools
import io
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from app.choices import DecodeChoice
from model.preprocessing import Preprocessing, luminance, normalize, resize_and_crop, to_float

EXIF_ORIENTATION = 0x0112
JPEG_END = b"\xff\xd9"


@dataclass(frozen=True)
class Jpeg:
    """A JPEG file whose header passed the checks, to be decoded on the GPU with its batch."""

    data: bytes | memoryview  # in the engine process, a view of a front-end's shared memory
    filename: str


def gpu_decodable(header: Image.Image, data: bytes | memoryview) -> bool:
    """A JPEG nvJPEG decodes as PIL would: baseline, RGB or grayscale, no EXIF rotation, not cut short."""
    if header.format != "JPEG" or header.mode not in ("RGB", "L") or header.info.get("progressive"):
        return False
    if not bytes(data).rstrip(b"\x00").endswith(JPEG_END):  # a truncated file goes to PIL, which says so
        return False
    return header.getexif().get(EXIF_ORIENTATION, 1) == 1


def blank_jpeg(shape: tuple[int, int, int]) -> bytes:
    """A grey JPEG of the given (channels, height, width): what the warm-up decodes."""
    channels, height, width = shape
    buffer = io.BytesIO()
    Image.new("RGB" if channels == 3 else "L", (width, height), 128).save(buffer, format="JPEG")
    return buffer.getvalue()


class JpegDecode(Protocol):
    """Files -> (3, H, W) uint8 RGB on the device, None where the GPU could not decode one; `name` says how."""

    name: str

    def __call__(self, files: Sequence[bytes | memoryview]) -> list[Tensor | None]: ...


class TorchvisionJpeg:
    """The CUDA decoder through torchvision's nvJPEG: files -> (3, H, W) uint8 RGB on the device, None where
    nvJPEG fails."""

    name = "the CUDA decoder (torchvision's nvJPEG)"

    def __init__(self, device: torch.device) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg  # here: only a GPU host decodes with nvJPEG

        self.decode_jpeg = functools.partial(decode_jpeg, mode=ImageReadMode.RGB, device=device)

    def __call__(self, files: Sequence[bytes | memoryview]) -> list[Tensor | None]:
        data = [torch.frombuffer(writable(f), dtype=torch.uint8) for f in files]
        with warnings.catch_warnings():
            # torchvision 0.29 announces that its image codecs will move to TorchCodec; they still work
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision")
            try:
                return list(self.decode_jpeg(data))
            except Exception:  # one bad file fails the batched call: decode each alone to find it
                return [self.decode_one(d) for d in data]

    def decode_one(self, data: Tensor) -> Tensor | None:
        try:
            return self.decode_jpeg(data)
        except Exception:  # nvJPEG's verdict on this file; PIL's decides
            return None


class NvImageCodecJpeg:
    """nvImageCodec's batched decoder: the hardware JPEG engines first (with `engines`, where the GPU has
    them), `load` of each batch (DALI's hw_decoder_load), then the CUDA decoder for the rest and for the files
    they leave. Files -> (3, H, W) uint8 RGB on the device, decoded on the current stream; None where both
    fail."""

    def __init__(self, device: torch.device, engines: bool = True, load: float = 1.0, batch: int = 256) -> None:
        from nvidia import nvimgcodec  # here: only a GPU host loads the codec library

        self.nvimgcodec = nvimgcodec
        self.device = device
        self.decoder = nvimgcodec.Decoder(
            device_id=device.index or 0, backends=decoder_backends(engines, load), options=preallocated(batch)
        )
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB)
        self.engines = engines and has_jpeg_engines(nvimgcodec, device)
        share = "" if load == 1 else f" ({load:g} of a batch)"
        self.name = f"the JPEG engines{share}, then the CUDA decoder" if self.engines else "the CUDA decoder"
        self.name += " (nvImageCodec)"

    def __call__(self, files: Sequence[bytes | memoryview]) -> list[Tensor | None]:
        stream = torch.cuda.current_stream(self.device)
        streams = [self.nvimgcodec.CodeStream(bytes(f)) for f in files]
        images = self.decoder.decode(streams, params=self.params, cuda_stream=stream.cuda_stream)
        # (H, W, C) -> (3, H, W): a grayscale file's one channel repeated, as torchvision's RGB mode gives it
        return [None if i is None else torch.from_dlpack(i).permute(2, 0, 1).expand(3, -1, -1) for i in images]


class DaliJpeg:
    """DALI's image decoder, a batch a call, through its dynamic mode: on a GPU its mixed decoder (the JPEG
    engines take `load` of a batch, DALI's hw_decoder_load; the CUDA decoder the rest and what they leave), on
    the caller's current stream; on the CPU its libjpeg-turbo decoder on `threads` threads. Files -> (3, H, W)
    uint8 RGB on the device, None where DALI fails."""

    def __init__(self, device: torch.device, load: float = 1.0, threads: int = 4) -> None:
        try:
            import nvidia.dali.experimental.dynamic as ndd  # here: DALI is an optional extra
            from nvidia.dali import types
        except ImportError as e:
            raise ValueError(f"VIT_DECODE=dali needs DALI: pip install 'vit-serve[dali]' ({e})") from None
        if not 0 < load <= 1:
            raise ValueError(f"the JPEG engines' load is a share of a batch in (0, 1], got {load}")
        self.ndd = ndd
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.index = (device.index or 0) if self.on_gpu else None
        self.pool = ndd.ThreadPool(threads, device_id=self.index)  # made once: a pool is costly to start
        options: dict[str, Any] = {"output_type": types.RGB}
        if self.on_gpu:
            options |= {"device": "gpu", "hw_decoder_load": load}  # dynamic mode's "gpu" is the mixed decoder
        else:
            options |= {"device": "cpu"}
        self.options = options
        share = "" if load == 1 else f" ({load:g} of a batch)"
        self.name = (
            f"DALI's mixed decoder (the JPEG engines{share}, then the CUDA decoder)"
            if self.on_gpu
            else "DALI's CPU decoder"
        )

    def __call__(self, files: Sequence[bytes | memoryview]) -> list[Tensor | None]:
        data = [np.frombuffer(f, dtype=np.uint8) for f in files]
        try:
            return self.decode(data)
        except RuntimeError:  # one bad file fails the batch: decode each alone to find it
            return [self.decode_one(d) for d in data]

    def decode(self, data: list[np.ndarray]) -> list[Tensor | None]:
        stream = torch.cuda.current_stream(self.device) if self.on_gpu else None
        with self.ndd.EvalContext(thread_pool=self.pool, device_id=self.index, cuda_stream=stream):
            decoded = self.ndd.decoders.image(self.ndd.batch(data), **self.options)
            # (H, W, 3) -> (3, H, W), zero-copy; on a GPU ordered after DALI's work on the current stream
            return [t.torch().permute(2, 0, 1) for t in decoded.tensors]

    def decode_one(self, data: np.ndarray) -> Tensor | None:
        try:
            return self.decode([data])[0]
        except RuntimeError:  # DALI's verdict on this file; PIL's decides
            return None


def decoder_backends(engines: bool, load: float) -> list[Any]:
    """nvImageCodec's backends, in the order it tries them: the hardware JPEG engines with `load` of a batch
    (with `engines`), then the CUDA decoder (Huffman on the CPU below 1 MP) for the rest."""
    from nvidia import nvimgcodec

    if not 0 < load <= 1:
        raise ValueError(f"the JPEG engines' load is a share of a batch in (0, 1], got {load}")
    backends = [nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY, load_hint=load)] if engines else []
    return [*backends, nvimgcodec.Backend(nvimgcodec.BackendKind.HYBRID_CPU_GPU)]


def preallocated(batch: int, side: int = 512) -> str:
    """nvImageCodec's options that give the engines buffers for a batch of `batch` images up to `side` x `side`
    when the decoder is made, rather than as batches need them: beside a forward that fills the SMs the engines
    decode more so (docs/performance.md, "The engines beside a forward")."""
    hints = {"preallocate_batch_size": batch, "preallocate_width_hint": side, "preallocate_height_hint": side}
    return " ".join(f"nvjpeg_hw_decoder:{k}={v}" for k, v in hints.items())


def writable(file: bytes | memoryview) -> bytearray | memoryview:
    """A buffer torch takes without a copy of its own: a writable view as it is (the arena's), else a copy
    (torch.frombuffer warns on read-only memory such as bytes)."""
    return file if isinstance(file, memoryview) and not file.readonly else bytearray(file)


def has_jpeg_engines(nvimgcodec: Any, device: torch.device) -> bool:
    """Whether the GPU decodes JPEGs in hardware: a blank JPEG through the engines alone comes back."""
    engines_only = nvimgcodec.Decoder(
        device_id=device.index or 0, backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)]
    )
    return engines_only.decode(nvimgcodec.CodeStream(blank_jpeg((3, 64, 64)))) is not None


def jpeg_decoder_for(choice: DecodeChoice, device: torch.device, hw_load: float = 1.0, batch: int = 256) -> JpegDecode:
    """The batch decoder `VIT_DECODE` names: `nvimgcodec` or `dali` (the engines given `hw_load` of a batch,
    VIT_HW_DECODER_LOAD; nvImageCodec's with buffers for `batch` images), or torchvision's nvJPEG for `auto`."""
    if choice == "nvimgcodec":
        return NvImageCodecJpeg(device, load=hw_load, batch=batch)
    if choice == "dali":
        return DaliJpeg(device, load=hw_load)
    return TorchvisionJpeg(device)


class GpuJpegDecoder:
    """`Jpeg` files -> normalised (N, C, S, S) float32 on the device, as `EvalTransform` makes them on the CPU.

    `decode` turns files into RGB images on the device (`jpeg_decoder_for`). The resize is the tensor transform's
    antialiased one (what `resize_backend="tensor"` checkpoints use on the CPU too); for `resize_backend="pil"`
    checkpoints it differs from PIL's by rounding. `fallback` decodes a file the GPU rejects on the CPU: it
    returns the file's (C, S, S) pixels or raises the client's error.
    """

    def __init__(
        self,
        p: Preprocessing,
        device: torch.device,
        fallback: Callable[[Jpeg], Tensor],
        decode: JpegDecode,
    ) -> None:
        self.decode = decode
        self.preprocessing = p
        self.device = device
        self.fallback = fallback

    def __call__(self, files: Sequence[Jpeg]) -> Tensor:
        p = self.preprocessing
        decoded = self.decode([f.data for f in files])
        out = torch.empty(len(files), p.channels, p.image_size, p.image_size, device=self.device)
        by_size: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, image in enumerate(decoded):
            if image is None:
                out[i] = self.fallback(files[i]).to(self.device, non_blocking=True)
            else:
                by_size[tuple(image.shape)].append(i)
        for rows in by_size.values():  # images of one size are resized together
            out[rows] = self.transform(torch.stack([decoded[i] for i in rows]))  # type: ignore[misc]
        return out

    def transform(self, images: Tensor) -> Tensor:
        """(n, 3, H, W) uint8 RGB -> (n, C, S, S) float32: channels, resize and crop, scale to [0, 1], normalise."""
        p = self.preprocessing
        if p.channels == 1:  # luminance rounded to uint8, as PIL's RGB -> L
            images = luminance(images.float()).round_().to(torch.uint8)
        return normalize(to_float(resize_and_crop(images, p)), p.mean, p.std)
