"""The page at / and the API docs: served from local files only, and working in a real browser.

The browser tests drive Debian's headless chromium through chromium-driver (selenium) against a real
uvicorn process serving the bundled checkpoint; every request the browser makes is read from its
DevTools log, so a request to any other host fails the test.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

from app.settings import BUNDLED_WEIGHTS
from harness.images import encode, held_out
from harness.server import ROOT, Server
from model.shapes import SHAPE_CLASSES, make_sample
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # real servers, a real browser

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
URL = re.compile(r"""(?:https?:)?//[A-Za-z0-9.-]+""")


# In process: what the app serves.


@pytest.fixture(scope="module")
def browser(request: pytest.FixtureRequest) -> Iterator[webdriver.Chrome]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        missing = "browser tests need Debian's chromium and chromium-driver: apt-get install chromium chromium-driver"
        if os.environ.get("CI") == "true" or request.config.getoption("--require-browser"):
            pytest.fail(missing)  # in CI a missing browser is a failure, never a silent skip
        pytest.skip(missing)
    options = Options()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="chromium-")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        f"--user-data-dir={profile}",
        "--window-size=1100,1400",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def service(serve: ServerFactory) -> Server:
    return serve(BUNDLED_WEIGHTS)


def requested_hosts(driver: webdriver.Chrome) -> set[str]:
    """Hosts of every network request since the last call (data:, blob: and chrome: URLs stay in the browser)."""
    hosts = set()
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            url = message["params"]["request"]["url"]
            if url.startswith(("http:", "https:", "ws:", "wss:")):
                hosts.add(url.split("/")[2])
    return hosts


def open_page(driver: webdriver.Chrome, server: Server) -> None:
    driver.get(f"{server.url}/")
    WebDriverWait(driver, 20).until(lambda d: d.find_element(By.ID, "model-name").text)


def upload(driver: webdriver.Chrome, tmp_path: Path, files: dict[str, bytes]) -> None:
    paths = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    driver.find_element(By.ID, "files").send_keys("\n".join(paths))
    driver.find_element(By.ID, "submit").click()


def result(driver: webdriver.Chrome, filename: str) -> Any:
    def settled(d: webdriver.Chrome) -> Any:
        for item in d.find_elements(By.CSS_SELECTOR, ".result"):
            if item.find_element(By.CSS_SELECTOR, ".filename").text == filename and not item.find_elements(
                By.CSS_SELECTOR, ".status:not([hidden])"
            ):
                return item
        return None

    return WebDriverWait(driver, 30).until(settled)


def overlay_loaded(driver: webdriver.Chrome, item: Any) -> bool:
    image = item.find_element(By.CSS_SELECTOR, ".overlay")
    return bool(driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", image))


@pytest.mark.browser
def test_star_shows_its_class_and_overlay_with_no_outside_request(
    browser: webdriver.Chrome, service: Server, tmp_path: Path
) -> None:
    requested_hosts(browser)  # drain what came before
    open_page(browser, service)
    assert browser.find_element(By.ID, "model-name").text == "vit-shapes"
    assert "64 × 64 px" in browser.find_element(By.ID, "model-input").text
    assert not browser.find_element(By.ID, "labels").is_displayed()  # a classifier's classes are its own
    upload(browser, tmp_path, {"star.png": held_out("star"), "ring.png": held_out("ring")})
    star = result(browser, "star.png")
    labels = [e.text for e in star.find_elements(By.CSS_SELECTOR, ".top-k .label")]
    assert labels[0] == "star" and len(labels) == 5
    assert overlay_loaded(browser, star)
    assert star.find_element(By.CSS_SELECTOR, ".overlay-caption").text == "rollout map · 8 × 8 grid"
    assert "8 × 8 patch grid" in star.find_element(By.CSS_SELECTOR, ".overlay").get_attribute("alt")
    assert result(browser, "ring.png").find_element(By.CSS_SELECTOR, ".top-k .label").text == "ring"
    order = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".result .filename")]
    assert order[:2] == ["star.png", "ring.png"]  # a batch keeps its order
    Select(star.find_element(By.CSS_SELECTOR, ".result-method")).select_by_value("last")
    WebDriverWait(browser, 20).until(
        lambda d: star.find_element(By.CSS_SELECTOR, ".overlay-caption").text == "last map · 8 × 8 grid"
    )
    assert overlay_loaded(browser, star)
    assert requested_hosts(browser) == {f"127.0.0.1:{service.port}"}


def camera_png() -> bytes:
    """scikit-image's cameraman: a photograph, nothing like a shape."""
    from skimage import data

    return encode(Image.fromarray(data.camera()))


@pytest.mark.browser
def test_the_page_says_whether_an_image_looks_like_what_the_model_knows(
    browser: webdriver.Chrome, service: Server, tmp_path: Path
) -> None:
    """For a model with reference statistics the page asks for the out-of-distribution score and says, beside
    the classes, whether the image looks like the model's own: against the score 99 in 100 of its held-out
    images stay under (the model's ood_p99)."""
    open_page(browser, service)
    p99 = httpx.get(f"{service.url}/v1/models", timeout=10).json()["models"][0]["ood_p99"]
    upload(browser, tmp_path, {"star.png": held_out("star"), "camera.png": camera_png()})
    star = result(browser, "star.png").find_element(By.CSS_SELECTOR, ".verdict")
    assert star.is_displayed() and "unlike" not in star.get_attribute("class")
    assert star.text.startswith("Looks like the images this model knows (score ")
    shown = f"{p99:.1f}" if p99 >= 10 else f"{p99:.2g}"  # as the page writes it: 28.8, 7.9, 0.49
    assert f"99 in 100 of its own images score at most {shown})" in star.text
    camera = result(browser, "camera.png").find_element(By.CSS_SELECTOR, ".verdict")
    assert camera.is_displayed() and "unlike" in camera.get_attribute("class")
    assert camera.text.startswith("Unlike the images this model knows (score ")
    score = float(camera.text.split("score ")[1].split(";")[0])
    assert score > p99
    # docs/api.md quotes the page's words for this photograph
    api = " ".join((ROOT / "docs" / "api.md").read_text().split())
    quoted = re.search(r"\*(Unlike the images this model knows \(score [^*]+)\*", api)
    assert quoted is not None and quoted[1] == " ".join(camera.text.split()), (quoted, camera.text)


@pytest.mark.browser
def test_the_verdict_follows_the_services_threshold(browser: webdriver.Chrome, tmp_path: Path) -> None:
    """Where VIT_OOD_THRESHOLD sets a threshold, the service's flag decides: a held-out star is unlike at 0.01 (its
    score, 1 - its top probability, is about 0.09 under label smoothing)."""
    with Server(BUNDLED_WEIGHTS, VIT_OOD_THRESHOLD="vit-shapes=0.01") as server:
        open_page(browser, server)
        upload(browser, tmp_path, {"star.png": held_out("star")})
        verdict = result(browser, "star.png").find_element(By.CSS_SELECTOR, ".verdict").text
        assert verdict.startswith("Unlike the images this model knows (score ")
        assert "judged by this service's threshold" in verdict


@pytest.mark.browser
def test_a_text_file_shows_the_api_error(browser: webdriver.Chrome, service: Server, tmp_path: Path) -> None:
    open_page(browser, service)
    upload(browser, tmp_path, {"notes.txt": b"not an image"})
    item = result(browser, "notes.txt")
    error = item.find_element(By.CSS_SELECTOR, ".error")
    assert error.is_displayed()
    assert error.text.startswith("notes.txt: not a recognised image; send one of image/bmp")
    assert not item.find_element(By.CSS_SELECTOR, ".thumb").is_displayed()  # no broken thumbnail


@pytest.mark.browser
@pytest.mark.parametrize("event", ["drop", "paste"])
def test_dropped_and_pasted_images_are_sent_at_once(browser: webdriver.Chrome, service: Server, event: str) -> None:
    open_page(browser, service)
    browser.execute_script(
        """
        const [bytes, kind] = arguments;
        const data = Uint8Array.from(atob(bytes), (c) => c.charCodeAt(0));
        const transfer = new DataTransfer();
        transfer.items.add(new File([data], `${kind}.png`, { type: "image/png" }));
        const target = kind === "drop" ? document.getElementById("drop-zone") : document;
        const e = kind === "drop"
          ? new DragEvent("drop", { dataTransfer: transfer, bubbles: true, cancelable: true })
          : new ClipboardEvent("paste", { clipboardData: transfer, bubbles: true, cancelable: true });
        target.dispatchEvent(e);
        """,
        base64.b64encode(held_out("arrow")).decode(),
        event,
    )
    item = result(browser, f"{event}.png")
    assert item.find_element(By.CSS_SELECTOR, ".top-k .label").text == "arrow"


@pytest.mark.browser
def test_controls_have_labels_and_the_page_fits_a_phone(browser: webdriver.Chrome, service: Server) -> None:
    open_page(browser, service)
    unlabelled = browser.execute_script(
        """
        return [...document.querySelectorAll("input, select, button")].filter((el) => {
          if (el.closest("template")) return false;
          return !(el.labels && el.labels.length) && !el.getAttribute("aria-label") && !el.textContent.trim();
        }).map((el) => el.id || el.outerHTML);
        """
    )
    assert unlabelled == []
    zone = browser.find_element(By.ID, "drop-zone")
    assert zone.get_attribute("tabindex") == "0" and zone.get_attribute("role") == "button"
    browser.set_window_size(390, 844)
    try:
        open_page(browser, service)
        overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0
    finally:
        browser.set_window_size(1100, 1400)


@pytest.mark.browser
def test_docs_render_offline(browser: webdriver.Chrome, service: Server) -> None:
    requested_hosts(browser)
    browser.get(f"{service.url}/docs")
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"))
    operations = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary")]
    assert any(op.startswith("POST") and "/predict" in op for op in operations), operations
    assert "Classify images" in browser.find_element(By.TAG_NAME, "body").text
    assert requested_hosts(browser) == {f"127.0.0.1:{service.port}"}


@pytest.mark.browser
def test_api_key_and_too_large_image_errors(browser: webdriver.Chrome, tmp_path: Path) -> None:
    """With VIT_API_KEYS set the key field appears on the first 401; the 413 for a large image is shown."""
    with Server(BUNDLED_WEIGHTS, VIT_API_KEYS="s3cret", VIT_MAX_IMAGE_PIXELS="1000") as server:
        open_page(browser, server)
        browser.execute_script("sessionStorage.clear()")
        assert not browser.find_element(By.ID, "api-key").is_displayed()
        small = encode(make_sample(3, 0).image.resize((24, 24)))
        upload(browser, tmp_path, {"small.png": small})
        error = result(browser, "small.png").find_element(By.CSS_SELECTOR, ".error")
        assert (
            error.text == "missing or invalid API key; send it in the X-API-Key header, or as Authorization: Bearer KEY"
        )
        key = browser.find_element(By.ID, "api-key")
        assert key.is_displayed()
        key.send_keys("s3cret")
        upload(browser, tmp_path, {"again.png": small, "large.png": held_out("star")})
        assert result(browser, "again.png").find_element(By.CSS_SELECTOR, ".top-k").is_displayed()
        large = result(browser, "large.png").find_element(By.CSS_SELECTOR, ".error").text
        assert large == "large.png: 64x64 = 4096 pixels is over the limit of 1000; resize it first"


@pytest.mark.browser
def test_model_picker_sends_images_to_the_chosen_model(
    browser: webdriver.Chrome, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    with Server(BUNDLED_WEIGHTS, VIT_MODELS=f"vit-shapes={BUNDLED_WEIGHTS},tiny={tiny_checkpoint}") as server:
        open_page(browser, server)
        picker = browser.find_element(By.ID, "model-select")
        assert picker.is_displayed()
        assert [o.get_attribute("value") for o in Select(picker).options] == ["vit-shapes", "tiny"]
        Select(picker).select_by_value("tiny")
        assert browser.find_element(By.ID, "model-name").text == "tiny"
        assert browser.find_element(By.ID, "model-input").text == "32 × 32 px, RGB"
        upload(browser, tmp_path, {"star.png": held_out("star")})
        item = result(browser, "star.png · tiny")
        assert item.find_element(By.CSS_SELECTOR, ".overlay-caption").text == "rollout map · 4 × 4 grid"  # tiny's grid
        assert not item.find_element(By.CSS_SELECTOR, ".verdict").is_displayed()  # no reference statistics


@pytest.mark.browser
def test_a_zero_shot_model_takes_the_labels_typed(browser: webdriver.Chrome, tmp_path: Path) -> None:
    """For a CLIP model the page shows a labels box; the classes shown are the labels typed there, with the
    probabilities the API gives for them; without labels, the API's 422 is shown."""
    from model.convert.__main__ import main as convert_main
    from tests.support.zero_shot import clip_repo

    repo = clip_repo(tmp_path / "repo")
    checkpoint = convert_main(["hf", "--model-dir", str(repo.path), "--output", str(tmp_path / "clip.safetensors")])
    star = held_out("star")
    with Server(checkpoint) as server:
        open_page(browser, server)
        assert (
            "named with each request (zero-shot, one softmax over them)"
            in browser.find_element(By.ID, "model-class-count").text
        )
        box = browser.find_element(By.ID, "labels")
        assert box.is_displayed() and box.get_attribute("value") == ""
        upload(browser, tmp_path, {"none.png": star})
        error = result(browser, "none.png").find_element(By.CSS_SELECTOR, ".error")
        assert error.is_displayed() and "no default labels" in error.text
        box.send_keys("cat, dog, a red car")
        upload(browser, tmp_path, {"star.png": star})
        shown = [e.text for e in result(browser, "star.png").find_elements(By.CSS_SELECTOR, ".top-k .label")]
        api = httpx.post(
            f"{server.url}/predict",
            params={"labels": "cat, dog, a red car"},
            files={"file": ("star.png", star, "image/png")},
            timeout=30,
        ).json()["results"][0]["top_k"]
        assert shown == [t["label"] for t in api] and sorted(shown) == ["a red car", "cat", "dog"]


@pytest.mark.browser
def test_one_model_shows_no_picker(browser: webdriver.Chrome, service: Server) -> None:
    open_page(browser, service)
    assert not browser.find_element(By.ID, "model-select").is_displayed()


@pytest.mark.browser
def test_a_head_taught_on_the_page_answers_for_new_images_at_once(browser: webdriver.Chrome, tmp_path: Path) -> None:
    """Images dropped under class names teach a head; it is chosen at once, and new images answer with its classes;
    teaching a name taken shows the API's reason."""
    shutil.copy(BUNDLED_WEIGHTS, tmp_path / "shapes.safetensors")  # its heads are written beside it
    taught = {"round": "circle", "donut": "ring"}
    found = {name: [i for i in range(400) if SHAPE_CLASSES[make_sample(7, i).label] == shape][:4]
             for name, shape in taught.items()}  # fmt: skip
    with Server(tmp_path / "shapes.safetensors") as server:
        open_page(browser, server)
        rows = browser.find_elements(By.CSS_SELECTOR, ".teach-class")
        assert len(rows) == 2
        for row, (name, indices) in zip(rows, found.items(), strict=True):
            paths = []
            for i in indices:
                (tmp_path / f"{name}{i}.png").write_bytes(encode(make_sample(7, i).image))
                paths.append(str(tmp_path / f"{name}{i}.png"))
            row.find_element(By.CSS_SELECTOR, ".class-name").send_keys(name)
            row.find_element(By.CSS_SELECTOR, ".class-files").send_keys("\n".join(paths))
            assert row.find_element(By.CSS_SELECTOR, ".class-count").text.startswith("4 images: ")
        browser.find_element(By.ID, "teach-submit").click()
        status = WebDriverWait(browser, 60).until(
            lambda d: d.find_element(By.ID, "teach-status").text if "Taught" in d.find_element(By.ID, "teach-status").text else None
        )  # fmt: skip
        assert status.startswith("Taught head mine on shapes: round 4, donut 4; ")
        assert Select(browser.find_element(By.ID, "head-select")).first_selected_option.get_attribute("value") == "mine"
        listed = httpx.get(f"{server.url}/v1/models/shapes/heads", timeout=10).json()["heads"]
        assert [(h["name"], h["examples"]) for h in listed] == [("mine", {"round": 4, "donut": 4})]
        upload(browser, tmp_path, {"ring.png": held_out("ring")})
        labels = [
            e.text for e in result(browser, "ring.png · head mine").find_elements(By.CSS_SELECTOR, ".top-k .label")
        ]
        assert labels == ["donut", "round"]
        browser.find_element(By.ID, "teach-submit").click()  # the same name again, replace unticked
        error = WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "teach-error").text or None)
        assert "already has a head named 'mine'" in error
