"""Read an HTTP request body within its limit, and a /predict request's images: multipart `file`/`files`, or a raw image body."""

from __future__ import annotations

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.core.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from app.core.request import EncodedImage

FILE_FIELDS = ("file", "files")


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
    request._body = body  # let request.form() parse the bytes already read
    return body


async def read_images(request: Request, max_bytes: int, max_files: int) -> list[EncodedImage]:
    """The image files of one request, in order; errors say what to send instead."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type.startswith("image/"):
        body = await read_body(request, max_bytes)
        return [EncodedImage(request.query_params.get("filename") or "body", body)]
    if content_type != "multipart/form-data":
        raise UnsupportedMediaType(
            f"unsupported Content-Type {content_type or '(none)'!r}: send multipart/form-data with field 'file' "
            "(or repeated 'files'), or the raw image bytes with an image/* Content-Type"
        )
    await read_body(request, max_bytes)
    try:
        form = await request.form(max_files=max_files, max_fields=max_files + 16)
    except StarletteHTTPException as e:  # malformed multipart, or too many parts
        raise InvalidInput(f"could not parse the multipart body: {e.detail}") from None
    uploads: list[EncodedImage] = []
    try:
        for name, value in form.multi_items():
            if not isinstance(value, UploadFile):
                continue
            if name not in FILE_FIELDS:
                raise InvalidInput(f"unexpected file field {name!r}; send images as 'file' or repeated 'files'")
            uploads.append(EncodedImage(value.filename or f"{name}[{len(uploads)}]", await value.read()))
    finally:
        await form.close()  # the parts' temporary files
    if not uploads:
        raise InvalidInput("no image in the request; send multipart field 'file' or repeated 'files'")
    if len(uploads) > max_files:
        raise InvalidInput(f"{len(uploads)} images in one request; at most {max_files} are accepted")
    return uploads
