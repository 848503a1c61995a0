"""Read an HTTP request body within its limit, a /predict request's images (multipart `file`/`files`, or a raw image
body), and the examples that teach a head (multipart, each class's images under its name)."""

from __future__ import annotations

import asyncio

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from app.core.contract.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from app.core.contract.request import EncodedImage

FILE_FIELDS = ("file", "files")
PARSE_ON_THE_LOOP_BYTES = 1024 * 1024  # larger bodies are parsed in a thread (docs/performance.md)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing anything over `limit` bytes before reading it when the length is declared."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidInput(f"invalid Content-Length header {declared!r}")
        if int(declared) > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_images(request: Request, max_bytes: int, max_files: int) -> list[EncodedImage]:
    """The image files of one request, in order; errors say what to send instead."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";")[0].strip().lower()
    if media_type.startswith("image/"):
        body = await read_body(request, max_bytes)
        return [EncodedImage(request.query_params.get("filename") or "body", body)]
    if media_type != "multipart/form-data":
        raise UnsupportedMediaType(
            f"unsupported Content-Type {media_type or '(none)'!r}: send multipart/form-data with field 'file' "
            "(or repeated 'files'), or the raw image bytes with an image/* Content-Type"
        )
    body = await read_body(request, max_bytes)
    if len(body) > PARSE_ON_THE_LOOP_BYTES:
        parts = await asyncio.to_thread(read_form, body, content_type, max_files)
    else:
        parts = read_form(body, content_type, max_files)
    uploads: list[EncodedImage] = []
    for name, filename, data in parts:
        if name not in FILE_FIELDS:
            raise InvalidInput(f"unexpected file field {name!r}; send images as 'file' or repeated 'files'")
        uploads.append(EncodedImage(filename or f"{name}[{len(uploads)}]", data))
    if not uploads:
        raise InvalidInput("no image in the request; send multipart field 'file' or repeated 'files'")
    if len(uploads) > max_files:
        raise InvalidInput(f"{len(uploads)} images in one request; at most {max_files} are accepted")
    return uploads


class FormParts:
    """The file parts of one multipart/form-data body, collected from python-multipart's streaming parser (the
    parser FastAPI and Starlette read forms with): (field name, file name, bytes) in order, at most `max_files`
    files and as many form fields and 16 more. Of form fields, only the names are kept
    (`names`, every part's in order)."""

    def __init__(self, max_files: int) -> None:
        self.max_files = max_files
        self.max_fields = max_files + 16
        self.files: list[tuple[str, str, bytes]] = []
        self.fields = 0
        self.names: list[str] = []  # of every part, file or field, in order
        self.header_field = self.header_value = b""
        self.headers: dict[bytes, bytes] = {}
        self.data: list[bytes] = []
        self.current: tuple[str, str] | None = None  # the file part being read: (field name, file name)

    def on_part_begin(self) -> None:
        self.headers, self.data, self.current = {}, [], None

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.headers[self.header_field.lower()] = self.header_value
        self.header_field = self.header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.headers.get(b"content-disposition", b""))
        if b"name" not in options:
            raise InvalidInput('could not parse the multipart body: a part\'s Content-Disposition has no "name"')
        self.names.append(text(options[b"name"]))
        if b"filename" in options:
            if len(self.files) >= self.max_files:
                raise InvalidInput(
                    f"could not parse the multipart body: Too many files. Maximum number of files is {self.max_files}."
                )
            self.current = (text(options[b"name"]), text(options[b"filename"]))
        else:
            self.fields += 1
            if self.fields > self.max_fields:
                raise InvalidInput(
                    f"could not parse the multipart body: Too many fields. Maximum number of fields is {self.max_fields}."
                )

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.current is not None:
            self.data.append(data[start:end])

    def on_part_end(self) -> None:
        if self.current is not None:
            self.files.append((*self.current, b"".join(self.data)))


def read_form(body: bytes, content_type: str, max_files: int) -> list[tuple[str, str, bytes]]:
    """The file parts of a multipart/form-data body (field name, file name, bytes) in order; InvalidInput for a
    body that is not one, or holds more than `max_files` files."""
    return parse_form(body, content_type, max_files).files


def parse_form(body: bytes, content_type: str, max_files: int) -> FormParts:
    """A multipart/form-data body's file parts and every part's name (`read_form`)."""
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise InvalidInput("could not parse the multipart body: its Content-Type names no boundary")
    parts = FormParts(max_files)
    callbacks = {name: getattr(parts, name) for name in CALLBACKS}
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        parser.write(body)
        parser.finalize()
    except MultipartParseError as e:  # malformed multipart
        raise InvalidInput(f"could not parse the multipart body: {e}") from None
    return parts


CALLBACKS = (
    "on_part_begin",
    "on_header_field",
    "on_header_value",
    "on_header_end",
    "on_headers_finished",
    "on_part_data",
    "on_part_end",
)


def text(value: bytes) -> str:
    """A header parameter as text: UTF-8, else Latin-1 (as browsers and Starlette read them)."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")


async def read_examples(request: Request, max_bytes: int, max_files: int) -> dict[str, list[EncodedImage]]:
    """A multipart body's example images by class, each class the field name its images came under, in the order
    first named; a field with no file (an empty file input, or a form field) names a class with none."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "multipart/form-data":
        raise UnsupportedMediaType(
            f"unsupported Content-Type {content_type.split(';')[0].strip() or '(none)'!r}: send multipart/form-data, "
            "each class's images as files under its name (curl -F 'ring=@ring1.png' -F 'ring=@ring2.png' "
            "-F 'circle=@circle1.png'), or name a folder of the model repository (folder=)"
        )
    body = await read_body(request, max_bytes)
    parts = await asyncio.to_thread(parse_form, body, content_type, max_files)
    examples: dict[str, list[EncodedImage]] = {}
    for name in parts.names:
        examples.setdefault(name, [])
    for name, filename, data in parts.files:
        images = examples.setdefault(name, [])
        if filename or data:  # an empty file input sends neither
            images.append(EncodedImage(filename or f"{name}[{len(images)}]", data))
    return examples
