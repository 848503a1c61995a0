"""multipart/form-data bodies already in memory, read into their parts as Starlette reads them: split at
their delimiters when laid out as clients send them, through python-multipart otherwise."""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field

from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

MAX_FIELD_BYTES = 1024 * 1024  # a part that is not a file (Starlette's limit)


class MultipartError(Exception):
    """A multipart body that cannot be parsed, or has too many parts."""


@dataclass
class Part:
    """One part of a multipart body: its field name, its file name (None for a field that is not a file)."""

    name: str = ""
    filename: str | None = None
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    disposition: bytes = b""

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)  # the one chunk itself when the body came in one piece


def parse_multipart(body: bytes, content_type: str, max_files: int, max_fields: int) -> list[Part]:
    """The parts of a multipart/form-data body already in memory, in order.

    They are read as Starlette's `Request.form()` reads them (the same limits, file names decoded in the
    body's charset, the same messages), straight into bytes: not through a spooled temporary file and an
    UploadFile per part (with them, 178 against 68 us for a 138 KB photo). A body laid out as clients
    send one is split where its delimiters are (`well_formed_parts`, about 10 us); anything else goes
    through python-multipart, Starlette's parser (about 60 us for one 9 KB photo).
    tests/app/web/test_multipart.py checks both against Starlette's parser.
    """
    _, params = parse_options_header(content_type)
    charset = params.get(b"charset", b"utf-8").decode("latin-1")
    try:
        charset = codecs.lookup(charset).name
    except LookupError:
        charset = "latin-1"
    if b"boundary" not in params:
        raise MultipartError("Missing boundary in multipart.")
    boundary = params[b"boundary"]
    naming = Naming(charset, max_files, max_fields)
    laid_out = well_formed_parts(body, boundary, max_parts=max_files + max_fields)
    if laid_out is None:
        return parse_streaming(body, boundary, naming)
    parts = [Part(chunks=[data], size=len(data), disposition=disposition) for disposition, data in laid_out]
    for part in parts:  # in order, as the streaming parser meets them: a part's name, then its size
        naming.name(part)
        naming.check_size(part)
    return parts


@dataclass
class Naming:
    """A part's field name and file name from its Content-Disposition, counted against the limits."""

    charset: str
    max_files: int
    max_fields: int
    files: int = 0
    fields: int = 0

    def name(self, part: Part) -> None:
        _, options = parse_options_header(part.disposition)
        if b"name" not in options:
            raise MultipartError('The Content-Disposition header field "name" must be provided.')
        part.name = decode(options[b"name"], self.charset)
        if b"filename" in options:
            self.files += 1
            if self.files > self.max_files:
                raise MultipartError(f"Too many files. Maximum number of files is {self.max_files}.")
            part.filename = decode(options[b"filename"], self.charset)
        else:
            self.fields += 1
            if self.fields > self.max_fields:
                raise MultipartError(f"Too many fields. Maximum number of fields is {self.max_fields}.")

    @staticmethod
    def check_size(part: Part) -> None:
        if part.filename is None and part.size > MAX_FIELD_BYTES:
            raise MultipartError(f"Part exceeded maximum size of {MAX_FIELD_BYTES // 1024}KB.")


MAX_HEADER_LINES = 8  # python-multipart's limits: more, or longer lines, are its to refuse
MAX_HEADER_LINE_BYTES = 4096
MAX_BOUNDARY_BYTES = 256
TOKEN = re.compile(rb"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")


def well_formed_parts(body: bytes, boundary: bytes, max_parts: int) -> list[tuple[bytes, bytes]] | None:
    """Each part's Content-Disposition and data, for a body in the plain layout of RFC 7578 (no preamble, no
    padding after a delimiter, header lines of a token, a colon and a value, each part closed, within
    python-multipart's limits, at most `max_parts` parts); None for any other body, for python-multipart to
    read or refuse (it stops at the first part over the limits)."""
    if len(boundary) > MAX_BOUNDARY_BYTES or not body.startswith(b"--" + boundary + b"\r\n"):
        return None
    delimiter = b"\r\n--" + boundary
    parts = []
    at = len(boundary) + 4
    while True:
        headers_end = body.find(b"\r\n\r\n", at)
        if headers_end < 0 or body.startswith(b"\r\n", at):
            return None
        disposition = None
        lines = body[at:headers_end].split(b"\r\n")
        if len(lines) > MAX_HEADER_LINES:
            return None
        for line in lines:
            name, colon, value = line.partition(b":")
            if not colon or len(line) > MAX_HEADER_LINE_BYTES or b"\r" in line or b"\n" in line:
                return None
            if not TOKEN.fullmatch(name):
                return None
            if name.lower() == b"content-disposition":
                disposition = value.lstrip(b" ")
        data_end = body.find(delimiter, headers_end + 4)
        if data_end < 0 or disposition is None:
            return None
        parts.append((disposition, body[headers_end + 4 : data_end]))
        if len(parts) > max_parts:
            return None
        after = data_end + len(delimiter)
        if body.startswith(b"--", after):
            return parts  # the closing delimiter: what follows it is ignored
        if not body.startswith(b"\r\n", after):
            return None
        at = after + 2


def parse_streaming(body: bytes, boundary: bytes, naming: Naming) -> list[Part]:
    """The parts as python-multipart's streaming parser finds them, for bodies `well_formed_parts` leaves."""
    parts: list[Part] = []  # those that ended: a part cut off by the end of the body is not one
    part = Part()
    header_name = header_value = b""

    def on_part_begin() -> None:
        nonlocal part
        part = Part()

    def on_part_end() -> None:
        parts.append(part)

    def on_part_data(data: bytes, start: int, end: int) -> None:
        part.size += end - start
        naming.check_size(part)
        part.chunks.append(data[start:end])

    def on_header_field(data: bytes, start: int, end: int) -> None:
        nonlocal header_name
        header_name += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        nonlocal header_value
        header_value += data[start:end]

    def on_header_end() -> None:
        nonlocal header_name, header_value
        if header_name.lower() == b"content-disposition":
            part.disposition = header_value
        header_name = header_value = b""

    def on_headers_finished() -> None:
        naming.name(part)

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished,
    }
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        parser.write(body)
        parser.finalize()
    except FormParserError:
        raise MultipartError("Invalid multipart data.") from None
    return parts


def decode(raw: bytes, charset: str) -> str:
    try:
        return raw.decode(charset)
    except (UnicodeDecodeError, LookupError):
        return raw.decode("latin-1")
