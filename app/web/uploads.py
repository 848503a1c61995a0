"""Read an HTTP request body within its limit, and a /predict request's images: multipart `file`/`files`, or a raw image body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

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
    body = b"".join(chunks)
    request._body = body  # request.body() answers the bytes already read
    return body


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
        parts = await asyncio.to_thread(asyncio.run, read_form(body, request.headers, max_files))
    else:
        parts = await read_form(body, request.headers, max_files)
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


async def read_form(body: bytes, headers: Headers, max_files: int) -> list[tuple[str, str, bytes]]:
    """The file parts of a multipart/form-data body (field name, file name, bytes) in order, read by Starlette's
    parser within `max_files` files and as many form fields and 16 more; form fields are left out."""

    async def chunks() -> AsyncIterator[bytes]:
        yield body

    parser = MultiPartParser(headers, chunks(), max_files=max_files, max_fields=max_files + 16)  # type: ignore[arg-type]
    try:
        form = await parser.parse()
    except MultiPartException as e:  # malformed multipart, or too many parts
        raise InvalidInput(f"could not parse the multipart body: {e.message}") from None
    files = []
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            value.file.seek(0)
            files.append((name, value.filename or "", value.file.read()))
            value.file.close()
    return files
