"""A plain JPEG told from its markers alone: the files the GPU decodes, found without PIL.

Where a model decodes plain JPEGs on the GPU, each file's header is checked on the CPU first (`open_image`,
then `gpu_decodable`): PIL reads the header, and its EXIF for the orientation, which is several times
slower, and the hand-off to a pool thread that runs it costs a serving process's event loop more again.
`plain_jpeg` reads the same facts from the file's markers on the caller's thread (docs/performance.md gives
the figures, from `python -m bench feature-cost`).

It answers True only for files the PIL check would send to the GPU, and only for the common shape of one: a
baseline or extended sequential JPEG (SOF0, SOF1) of 8 bits and one or three components, within the pixel
limit, at most 64 segments, each whole, at most one EXIF block whose orientation, if it has one, is upright, no other APP1
segment (XMP, where PIL reads an orientation too), no MPF (PIL then opens the file as an MPO), no Photoshop
resources (PIL walks them), and the file ending in its end-of-image marker. Anything else, unusual or broken, answers False: the caller then asks PIL, as before,
whose verdict (the GPU, the CPU, or a 4xx) stands.
"""

from __future__ import annotations

import struct

SOI = b"\xff\xd8\xff"
SOF_SEQUENTIAL = (0xC0, 0xC1)  # baseline and extended sequential DCT, Huffman-coded
SOS, DQT = 0xDA, 0xDB
SKIPPED = frozenset({0xC4, 0xDD, 0xFE})  # DHT, DRI, COM: PIL skips them as a decoder needs them
APP0, APP1, APP2, APP13, APP14 = 0xE0, 0xE1, 0xE2, 0xED, 0xEE
EXIF, MPF, PHOTOSHOP = b"Exif\x00\x00", b"MPF\x00", b"Photoshop 3.0\x00"
ORIENTATION, SHORT = 0x0112, 3
TIFF_ORDER = {b"II*\x00": "<", b"MM\x00*": ">"}
# It runs on a serving process's event loop: a file with more segments, or an EXIF directory with more entries,
# than a camera or an encoder writes is left to PIL on the pool rather than walked here.
MAX_SEGMENTS = 64
MAX_ENTRIES = 256


def plain_jpeg(data: bytes | memoryview, max_pixels: int) -> bool:
    """Whether PIL's check (`open_image` within `max_pixels`, then `gpu_decodable`) would send this file to the
    GPU, read from its markers; False also where it cannot tell (the caller then asks PIL)."""
    view = memoryview(data)
    if view[:3] != SOI:
        return False
    size = len(view)
    at, frame, exif = 2, False, False
    for _ in range(MAX_SEGMENTS):
        if at + 4 > size or view[at] != 0xFF:
            return False  # cut short, or bytes between segments (PIL skips them; here: ask PIL)
        marker = view[at + 1]
        length = view[at + 2] << 8 | view[at + 3]
        start, end = at + 4, at + 2 + length
        if length < 2 or end > size:
            return False
        if marker == SOS:
            break
        segment = view[start:end]
        if marker in SOF_SEQUENTIAL:
            if frame or not sequential_frame(segment, max_pixels):
                return False
            frame = True
        elif marker == DQT:
            if not quantization_tables(segment):
                return False
        elif APP0 <= marker <= APP0 + 15:
            if marker == APP1:
                if segment[:6] == EXIF:
                    if exif or not upright(segment[6:]):
                        return False
                    exif = True
                else:
                    return False  # XMP, or what PIL might read an orientation from
            elif marker == APP2 and segment[:4] == MPF:
                return False
            elif marker == APP0 and segment[:4] == b"JFIF" and len(segment) < 14:
                return False  # PIL reads the JFIF version and density without a guard
            elif marker == APP14 and segment[:5] == b"Adobe" and len(segment) < 12:
                return False
            elif marker == APP13 and segment[:14] == PHOTOSHOP:
                return False  # PIL walks its resources, and a cut one can fail the open
        elif marker not in SKIPPED:
            return False  # arithmetic coding, progressive and lossless frames, hierarchical markers
        at = end
    else:
        return False
    return frame and ends_whole(view)


def sequential_frame(segment: memoryview, max_pixels: int) -> bool:
    """An 8-bit frame of one or three components, with pixels and within `max_pixels`."""
    if len(segment) < 6:
        return False
    precision, height, width, components = struct.unpack_from(">BHHB", segment)
    if precision != 8 or components not in (1, 3) or len(segment) < 6 + 3 * components:
        return False
    return width >= 1 and height >= 1 and width * height <= max_pixels


def quantization_tables(segment: memoryview) -> bool:
    """The tables as PIL reads them: each whole (64 entries of one or two bytes after its byte of precision)."""
    at = 0
    while at < len(segment):
        at += 1 + (1 if segment[at] < 16 else 2) * 64
    return at == len(segment)


def upright(tiff: memoryview) -> bool:
    """Whether EXIF's first directory, read whole, holds no orientation or one SHORT orientation of 1."""
    order = TIFF_ORDER.get(bytes(tiff[:4]))
    if order is None or len(tiff) < 8:
        return False
    (first,) = struct.unpack_from(order + "I", tiff, 4)
    if first < 8 or first + 2 > len(tiff):
        return False
    (count,) = struct.unpack_from(order + "H", tiff, first)
    if count > MAX_ENTRIES or first + 2 + 12 * count + 4 > len(tiff):
        return False  # PIL reads what it can of a directory cut short: ask it
    orientations = []
    for entry in range(first + 2, first + 2 + 12 * count, 12):
        tag, kind, values = struct.unpack_from(order + "HHI", tiff, entry)
        if tag == ORIENTATION:
            if kind != SHORT or values != 1:
                return False
            orientations.append(struct.unpack_from(order + "H", tiff, entry + 8)[0])
    return orientations in ([], [1])


def ends_whole(view: memoryview) -> bool:
    """The file ends in its end-of-image marker, zero bytes after it aside (what `gpu_decodable` checks)."""
    tail = bytes(view[-64:]).rstrip(b"\x00")
    if not tail and len(view) > 64:
        tail = bytes(view).rstrip(b"\x00")
    return tail.endswith(b"\xff\xd9")
