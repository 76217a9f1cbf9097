"""Screenshots of TensorBoard opened on a sweep folder, as a reader sees it: the Images tab where
it lands (``docs/dashboard_images.png``) and the sweep's two figures at their own size
(``docs/dashboard_sweep.png``), taken by headless Chromium (``tests/app/browser.py``).

From a checkout, in the folder that holds ``multirun/`` (TensorBoard shows the log folder as
given, so the pictures show the sweep's relative path)::

    python scripts/train.py -m penalty=none,double_backprop penalty.weight=0.03,0.1,0.3,1 \\
        seed=0,1,2 callbacks=dashboards
    python scripts/dashboard_screenshots.py multirun/<date>/<time> docs

Needs Debian's ``chromium``. The pictures of the other tabs come from
``tests/app/test_dashboards.py`` (``GRADREG_SCREENSHOTS=docs``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.app.browser import Chromium  # noqa: E402 (the checkout's tests package)
from tests.tensorboard_server import poll, start_tensorboard, stop  # noqa: E402

#: the browser window, in CSS pixels; taller for the sweep's two figures at their own size
WIDTH, HEIGHT, SWEEP_HEIGHT = 1600, 1200, 1950
#: seconds for the cards' images to load and draw
SETTLE_S = 3.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="the sweep folder (multirun/<date>/<time>)")
    parser.add_argument("out", type=Path, help="the folder for the two pictures (docs)")
    args = parser.parse_args()
    if not (args.sweep / "summary").is_dir():
        parser.error(f"{args.sweep} has no summary/ run: run a sweep with TensorBoard logging")
    with tempfile.TemporaryDirectory() as scratch:
        server, url = start_tensorboard(args.sweep, Path(scratch) / "tensorboard.log")
        browser = Chromium(Path(scratch) / "profile", width=WIDTH, height=HEIGHT)
        try:
            poll(f"{url}/data/plugin/images/tags", lambda tags: "summary" in tags)
            browser.open(f"{url}/#images")
            browser.wait_for_text("Sweep/metric_vs_weight", "Sweep/validation_curves")
            time.sleep(SETTLE_S)
            browser.screenshot(args.out / "dashboard_images.png")
            browser.open(f"{url}/#images&tagFilter=Sweep/")
            browser.wait_for_text("Sweep/metric_vs_weight", "Sweep/validation_curves")
            browser.click_checkbox("Show actual image size")
            browser.resize(WIDTH, SWEEP_HEIGHT)
            time.sleep(SETTLE_S)
            browser.screenshot(args.out / "dashboard_sweep.png")
        finally:
            browser.close()
            stop(server)


if __name__ == "__main__":
    main()
