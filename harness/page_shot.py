"""The page at / as the README and docs/api.md show it: a real server on the bundled checkpoint, Debian's headless
chromium, the first star of the held-out `shapes` set and a text file classified, the whole page captured.

    python -m harness.page_shot docs/page.png
"""

from __future__ import annotations

import argparse
import base64
import shutil
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from app.settings import BUNDLED_WEIGHTS
from harness.images import held_out
from harness.server import Server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
WIDTH = 1000  # CSS pixels; the height is the page's own


def browser(profile: Path) -> webdriver.Chrome:
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.add_argument(f"--window-size={WIDTH},1400")
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def shoot(url: str, folder: Path) -> bytes:
    """The page at `url` after classifying star.png and notes.txt, as a PNG of the whole page."""
    files = {"star.png": held_out("star"), "notes.txt": b"not an image\n"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    driver = browser(folder / "profile")
    try:
        driver.get(url)
        WebDriverWait(driver, 20).until(lambda d: d.find_element(By.ID, "model-name").text)
        driver.find_element(By.ID, "files").send_keys("\n".join(str(folder / name) for name in files))
        driver.find_element(By.ID, "submit").click()

        def settled(d: webdriver.Chrome) -> bool:
            """Both answered, and the star's attention map drawn."""
            done = {}
            for item in d.find_elements(By.CSS_SELECTOR, ".result"):
                if not item.find_elements(By.CSS_SELECTOR, ".status:not([hidden])"):
                    done[item.find_element(By.CSS_SELECTOR, ".filename").text] = item
            if set(done) != set(files):
                return False
            overlay = done["star.png"].find_elements(By.CSS_SELECTOR, ".overlay")
            return bool(overlay) and bool(
                d.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", overlay[0])
            )

        WebDriverWait(driver, 30).until(settled)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        metrics = {"width": WIDTH, "height": height, "deviceScaleFactor": 1, "mobile": False}
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        time.sleep(0.5)  # laid out again at that height
        return base64.b64decode(driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})["data"])
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.page_shot", description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="where the PNG goes (docs/page.png)")
    args = parser.parse_args()
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        raise SystemExit("needs Debian's chromium and chromium-driver: apt-get install chromium chromium-driver")
    folder = Path(tempfile.mkdtemp(prefix="page-shot-"))
    try:
        with Server(BUNDLED_WEIGHTS) as server:
            args.output.write_bytes(shoot(f"{server.url}/", folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
