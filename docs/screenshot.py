"""Capture the dataserver's live page as a PNG, 1280 px wide and as tall as the page, once its data is drawn.

    .venv/bin/python docs/screenshot.py docs/dashboard.png --url http://127.0.0.1:8000/

Needs a running dataserver (with an API key: ``--url 'http://HOST:PORT/#key=KEY'``) and headless Chromium
(``apt-get install chromium``); it drives Chromium with the DevTools client of the browser tests.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cdp import Browser


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--url", default="http://127.0.0.1:8000/", help="the page (default: %(default)s)")
    parser.add_argument("--width", type=int, default=1280, help="CSS pixels (default: %(default)s)")
    args = parser.parse_args()
    with Browser(width=args.width) as browser:
        browser.navigate(args.url)
        state = browser.wait_for(
            "document.body.dataset.state !== 'loading' && document.body.dataset.state", "the page's first answer"
        )
        if state != "ok":
            notice = browser.evaluate("document.getElementById('notice').textContent")
            raise SystemExit(f"the page could not load its data: {notice}")
        browser.screenshot(args.out, width=args.width)
    print(f"wrote {args.out}")  # noqa: T201


if __name__ == "__main__":
    main()
