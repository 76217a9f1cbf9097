"""A headless Chromium driven over the DevTools protocol, standard library only.

``--remote-debugging-pipe`` makes Chromium read protocol commands from file descriptor 3 and write
replies and events to descriptor 4, each message JSON ended by a NUL byte; so no websocket client
is needed. :meth:`Chromium.text` returns what a person reads on the page (text nodes, through
shadow roots, which ``--dump-dom`` leaves out); :meth:`Chromium.screenshot` the pixels.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

# flags for a sandbox-less headless run as root that makes no connection of its own
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--remote-debugging-pipe"]

# the visible text of the page: text nodes, shadow roots included, joined by single spaces
VISIBLE_TEXT = """(() => {
  const parts = [];
  const walk = (node) => {
    if (node.nodeType === Node.TEXT_NODE) { parts.push(node.textContent); return; }
    if (['SCRIPT', 'STYLE', 'NOSCRIPT'].includes(node.tagName)) return;
    if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.childNodes) walk(child);
  };
  walk(document.body);
  return parts.join(' ').replace(/\\s+/g, ' ');
})()"""


# the images on the page, through shadow roots: [src, natural width, natural height] of each
IMAGES = """(() => {
  const found = [];
  const walk = (node) => {
    if (node.tagName === 'IMG') found.push([node.src, node.naturalWidth, node.naturalHeight]);
    if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.childNodes) walk(child);
  };
  walk(document.body);
  return found;
})()"""

# click the checkbox (Polymer's paper-checkbox, Angular's mat-checkbox) labelled LABEL (a JSON
# string), through shadow roots; true where one was found
CLICK_CHECKBOX = """(() => {
  const label = LABEL;
  const find = (node) => {
    if (['PAPER-CHECKBOX', 'MAT-CHECKBOX'].includes(node.tagName)
        && node.textContent.trim() === label) return node;
    for (const child of [...(node.shadowRoot ? [node.shadowRoot] : []), ...node.childNodes]) {
      const found = find(child);
      if (found) return found;
    }
    return null;
  };
  const box = find(document.body);
  if (box) box.click();
  return box !== null;
})()"""


def executable() -> str | None:
    """Debian's ``chromium``, or None where it is not installed."""
    return shutil.which("chromium")


class Chromium:
    """One headless browser with one page of ``width`` x ``height`` CSS pixels."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 900) -> None:
        binary = executable()
        if binary is None:
            raise RuntimeError("chromium is not installed (Debian: apt-get install chromium)")
        commands_in, self._commands = os.pipe()
        self._replies, replies_out = os.pipe()

        def wire_descriptors() -> None:  # in the child, before exec: 3 = commands, 4 = replies
            os.dup2(commands_in, 3)
            os.dup2(replies_out, 4)

        self.process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "about:blank"],
            preexec_fn=wire_descriptors, pass_fds=(3, 4),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        os.close(commands_in)
        os.close(replies_out)
        self._buffer = b""
        self._id = 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.resize(width, height)

    def call(self, method: str, *, session: bool = False, timeout: float = 30.0,
             **params: Any) -> dict[str, Any]:
        """Send one command (to the page's session if ``session``) and return its result."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._next(deadline)
            if reply.get("id") == self._id:  # events (no id) and other replies are skipped
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def _next(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            wait = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._replies], [], [], wait)
            if not ready:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited with {self.process.wait()}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def resize(self, width: int, height: int) -> None:
        """The page's size in CSS pixels (a screenshot's size)."""
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width,
                  height=height, deviceScaleFactor=1, mobile=False)

    def open(self, url: str) -> None:
        """Load ``url`` afresh (through a blank page, so a change of ``#fragment`` alone loads
        the page again rather than staying in the same document)."""
        self.call("Page.navigate", session=True, url="about:blank")
        self.call("Page.navigate", session=True, url=url)

    def text(self) -> str:
        result = self.call("Runtime.evaluate", session=True, expression=VISIBLE_TEXT,
                           returnByValue=True)
        return result["result"].get("value", "")

    def wait_for_text(self, *needles: str, timeout: float = 60.0) -> str:
        """The page's visible text once it contains every needle (it renders asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            missing = [needle for needle in needles if needle not in text]
            if not missing:
                return text
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never showed {missing}; it shows: {text[:2000]}")
            time.sleep(0.5)

    def images(self) -> list[tuple[str, int, int]]:
        """Each image on the page (shadow roots included): its address and natural width and
        height in pixels (0 x 0 while it has not loaded)."""
        result = self.call("Runtime.evaluate", session=True, expression=IMAGES,
                           returnByValue=True)
        return [tuple(image) for image in result["result"].get("value", [])]

    def click_checkbox(self, label: str) -> None:
        """Click the checkbox labelled ``label`` (e.g. a column of the HParams table)."""
        result = self.call("Runtime.evaluate", session=True,
                           expression=CLICK_CHECKBOX.replace("LABEL", json.dumps(label)),
                           returnByValue=True)
        if not result["result"].get("value"):
            raise LookupError(f"no checkbox labelled {label!r} on the page")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._replies)
