#!/usr/bin/env python
"""A screenshot of `transformer serve`'s page for the docs: starts the server on 127.0.0.1 (a free port), types a
sentence into the page in headless Chromium, waits for the translation, the beam search and the attention
grid, and saves a PNG.

    python scripts/screenshot_serve.py RUN_DIR_OR_CHECKPOINT docs/images/serve.png \
        [--text "Ein Mann fährt mit dem Fahrrad die Straße entlang."] [--size 1280x900] [--full-page] \
        [--kind cross] [--layer 2 --head 3] [--hover 1] [--step 3] [--device cpu]

Needs the serve extra (pip install -e '.[serve]'), Selenium (pip install selenium) and Debian's Chromium with
its driver (apt-get install chromium chromium-driver); nothing is fetched from the network.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from transformer.serve.server import spawn

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="run directory or .pt file")
    ap.add_argument("out", help="PNG file to write")
    ap.add_argument(
        "--text", default="Ein Mann fährt mit dem Fahrrad die Straße entlang.", help="the sentence typed into the page"
    )
    ap.add_argument("--size", default="1280x900", help="browser window WIDTHxHEIGHT (default 1280x900)")
    ap.add_argument("--full-page", action="store_true", help="grow the window to the whole page's height")
    ap.add_argument("--kind", choices=("encoder", "decoder", "cross"), default="cross", help="attention tab to show")
    ap.add_argument("--layer", type=int, help="layer to draw large (1-based; default: the last)")
    ap.add_argument("--head", type=int, default=1, help="head to draw large (1-based)")
    ap.add_argument("--hover", type=int, help="hover this query piece (0-based) in the lines view")
    ap.add_argument("--step", type=int, help="beam search step to show (default: the middle one)")
    ap.add_argument("--device", default="cpu", help="where the server runs the model (default cpu)")
    args = ap.parse_args()

    try:
        from selenium import webdriver
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait
    except ImportError:
        sys.exit("error: this script needs selenium: pip install selenium")
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        sys.exit("error: this script needs chromium and chromedriver: apt-get install chromium chromium-driver")
    width, height = (int(v) for v in args.size.lower().split("x"))

    server, url = spawn(args.checkpoint, "--device", args.device)
    profile = tempfile.TemporaryDirectory(prefix="chromium-profile-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS + (f"--window-size={width},{height}", f"--user-data-dir={profile.name}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        driver.get(url + "/")
        wait = WebDriverWait(driver, 120)
        state = lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state")  # noqa: E731
        wait.until(lambda d: state(d) == "idle")
        driver.find_element(By.ID, "text").send_keys(args.text)
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: state(d) in ("ready", "error"))
        if state(driver) == "error":
            sys.exit(f"error: the page says: {driver.find_element(By.ID, 'error').text}")
        driver.find_element(
            By.XPATH, f"//div[@id='kinds']/button[{('encoder', 'decoder', 'cross').index(args.kind) + 1}]"
        ).click()
        layers = max(int(t.get_attribute("data-layer")) for t in driver.find_elements(By.CSS_SELECTOR, "#grid canvas"))
        layer = layers if args.layer is None else args.layer - 1
        driver.find_element(By.CSS_SELECTOR, f"#grid canvas[data-layer='{layer}'][data-head='{args.head - 1}']").click()
        steps = int(driver.find_element(By.ID, "step").get_attribute("max"))
        step = args.step or (steps + 1) // 2
        for _ in range(step - 1):
            driver.find_element(By.ID, "step-next").click()
        if args.full_page:  # a viewport as tall as the page (a window that tall may be clamped to the screen)
            total = driver.execute_script("return document.documentElement.scrollHeight")
            driver.execute_cdp_cmd(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": total, "deviceScaleFactor": 1, "mobile": False},
            )
        if args.hover is not None:
            target = driver.find_element(By.CSS_SELECTOR, f"#lines text[data-query='{args.hover}']")
            ActionChains(driver).move_to_element(target).perform()
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if not driver.save_screenshot(str(out)):
            sys.exit(f"error: could not write {out}")
        print(out)
    finally:
        driver.quit()
        server.terminate()
        server.wait(timeout=30)
        profile.cleanup()


if __name__ == "__main__":
    main()
