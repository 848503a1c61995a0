"""The multipart parser of /predict reads a body into the same parts, with the same errors, as Starlette's
`Request.form()`, which it replaces on that route: over crafted bodies and thousands of generated ones,
whole, cut short and with bytes changed. Bodies laid out as clients lay them out are split at their
delimiters, without the streaming parser."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from app.web.multipart import MultipartError, parse_multipart, well_formed_parts

# Starlette leaves the spooled temporary file of a part cut short unclosed (a ResourceWarning when it is
# collected); the parser under test opens no file
pytestmark = pytest.mark.filterwarnings("ignore:Exception ignored in. <function SpooledTemporaryFile.__del__")
BOUNDARY = "b0undary7e3f"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
MAX_FILES, MAX_FIELDS = 3, 4
Outcome = list[tuple[str, str | None, bytes | None]] | str


def ours(body: bytes, content_type: str) -> Outcome:
    try:
        parts = parse_multipart(body, content_type, max_files=MAX_FILES, max_fields=MAX_FIELDS)
    except MultipartError as e:
        return str(e)
    return [(p.name, p.filename, p.data if p.filename is not None else None) for p in parts]


def starlettes(body: bytes, content_type: str) -> Outcome:
    async def parse() -> Outcome:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        headers = [(b"content-type", content_type.encode("latin-1"))]
        request = Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)
        try:
            form = await request.form(max_files=MAX_FILES, max_fields=MAX_FIELDS)
        except MultiPartException as e:
            return e.message
        found: Outcome = []
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                found.append((name, value.filename, await value.read()))
            else:
                found.append((name, None, None))
        await form.close()
        return found

    return asyncio.run(parse())


def part(name: bytes, data: bytes, filename: bytes | None = None, content_type: bytes | None = None) -> bytes:
    disposition = b'Content-Disposition: form-data; name="' + name + b'"'
    if filename is not None:
        disposition += b'; filename="' + filename + b'"'
    headers = disposition + (b"\r\nContent-Type: " + content_type if content_type else b"")
    return b"--" + BOUNDARY.encode() + b"\r\n" + headers + b"\r\n\r\n" + data + b"\r\n"


def body(*parts: bytes) -> bytes:
    return b"".join(parts) + b"--" + BOUNDARY.encode() + b"--\r\n"


PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
CRAFTED = {
    "one file": body(part(b"file", PNG, b"a.png", b"image/png")),
    "files and a field": body(part(b"files", PNG, b"a.png"), part(b"note", b"hi"), part(b"files", b"xyz", b"b.png")),
    "an empty file name": body(part(b"file", PNG, b"")),
    "a UTF-8 file name": body(part(b"file", PNG, "photo été 写真.jpg".encode())),
    "a file name not in UTF-8": body(part(b"file", PNG, "été.jpg".encode("latin-1"))),
    "data holding the boundary's start": body(part(b"file", b"--" + BOUNDARY.encode()[:-1] + b"\r\n--", b"a")),
    "an empty file": body(part(b"file", b"", b"empty.png")),
    "too many files": body(*(part(b"files", PNG, f"{i}.png".encode()) for i in range(MAX_FILES + 1))),
    "too many fields": body(*(part(f"f{i}".encode(), b"v") for i in range(MAX_FIELDS + 1))),
    "a field over 1 MB": body(part(b"note", b"x" * (1024 * 1024 + 1))),
    "a file over 1 MB": body(part(b"file", b"x" * (1024 * 1024 + 1), b"big.bin")),
    "no name": b"--" + BOUNDARY.encode() + b'\r\nContent-Disposition: form-data; filename="a"\r\n\r\nx\r\n',
    "cut short in a file": body(part(b"file", PNG, b"a.png"))[:200],
    "cut short in the headers": body(part(b"file", PNG, b"a.png"))[:60],
    "no closing boundary": part(b"file", PNG, b"a.png"),
    "a bad header line": b"--" + BOUNDARY.encode() + b"\r\nno colon here\r\n\r\nx\r\n",
    "no boundary at all": PNG,
    "empty": b"",
}


@pytest.mark.parametrize("case", CRAFTED)
def test_crafted_bodies_read_as_starlette_reads_them(case: str) -> None:
    assert ours(CRAFTED[case], CONTENT_TYPE) == starlettes(CRAFTED[case], CONTENT_TYPE)


@pytest.mark.parametrize(
    "content_type",
    [
        "multipart/form-data",  # no boundary
        f"multipart/form-data; boundary={BOUNDARY}; charset=latin-1",
        f'multipart/form-data; boundary="{BOUNDARY}"; charset=no-such-codec',
    ],
)
def test_content_type_parameters_read_as_starlette_reads_them(content_type: str) -> None:
    data = body(part(b"file", PNG, "été.png".encode()), part(b"n\xe9", b"v"))
    assert ours(data, content_type) == starlettes(data, content_type)


names = st.one_of(st.sampled_from([b"file", b"files", b"note"]), st.text(max_size=8).map(str.encode))
filenames = st.one_of(st.none(), st.text(max_size=12).map(str.encode), st.binary(max_size=12))
parts = st.builds(
    part,
    names.filter(lambda n: b'"' not in n and b"\r" not in n and b"\n" not in n),
    st.one_of(st.binary(max_size=300), st.sampled_from([PNG, b"--" + BOUNDARY.encode(), b"\r\n--"])),
    filenames.filter(lambda n: n is None or (b'"' not in n and b"\r" not in n and b"\n" not in n)),
    st.one_of(st.none(), st.sampled_from([b"image/png", b"text/plain"])),
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    data = bytearray(body(*draw(st.lists(parts, max_size=6))))
    for _ in range(draw(st.integers(0, 3))):  # bytes changed
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):  # cut short
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_generated_bodies_read_as_starlette_reads_them(data: bytes) -> None:
    assert ours(data, CONTENT_TYPE) == starlettes(data, CONTENT_TYPE)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(parts, min_size=1, max_size=6))
def test_bodies_laid_out_plainly_are_split_at_their_delimiters(drawn: list[bytes]) -> None:
    data = body(*drawn)
    assert well_formed_parts(data, BOUNDARY.encode(), max_parts=6) is not None
    assert ours(data, CONTENT_TYPE) == starlettes(data, CONTENT_TYPE)


def test_a_clients_body_is_split_at_its_delimiters() -> None:
    files = [("files", ("a.png", PNG, "image/png")), ("files", ("b.jpg", b"\xff\xd8" * 100, "image/jpeg"))]
    sent = httpx.Request("POST", "http://test/predict", files=files, data={"note": "hi"})
    content_type, data = sent.headers["content-type"], sent.read()
    boundary = content_type.split("boundary=")[1].encode()
    assert [d.split(b";")[0] for d, _ in well_formed_parts(data, boundary, max_parts=3) or []] == [b"form-data"] * 3
    found = ours(data, content_type)
    assert found == starlettes(data, content_type)
    assert found == [("note", None, None), ("files", "a.png", PNG), ("files", "b.jpg", b"\xff\xd8" * 100)]


@pytest.mark.parametrize(
    "case",
    ["cut short in a file", "no closing boundary", "a bad header line", "no name", "cut short in the headers"],
)
def test_other_bodies_are_left_to_the_streaming_parser(case: str) -> None:
    assert well_formed_parts(CRAFTED[case], BOUNDARY.encode(), max_parts=MAX_FILES + MAX_FIELDS) is None


def test_a_body_of_more_parts_than_the_limits_is_not_split_whole() -> None:
    many = body(*(part(f"f{i}".encode(), b"v") for i in range(1000)))
    assert well_formed_parts(many, BOUNDARY.encode(), max_parts=MAX_FILES + MAX_FIELDS) is None
    assert (
        ours(many, CONTENT_TYPE) == starlettes(many, CONTENT_TYPE) == "Too many fields. Maximum number of fields is 4."
    )
