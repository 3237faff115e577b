"""Take a PNG screenshot of a web page with headless Chromium, once the page says it is ready.

`chromium --screenshot` shoots when the page's load event has fired (or when a virtual time
budget runs out), which is too early for pages that work in a Web Worker: Perfetto's UI is
still parsing the trace in WebAssembly then. So this drives Chromium over the DevTools
protocol on a pipe (`--remote-debugging-pipe`, standard library only, no port opened): it
opens the URL, polls a JavaScript expression until it is true, optionally runs more
JavaScript, waits a moment for the page to paint, and captures the viewport or a clip of it.

    python3 screenshot.py URL OUT.png [--size 1400x800] [--ready JS] [--then JS] [--clip X,Y,W,H]
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any


class DevTools:
    """A DevTools protocol session with one page, over Chromium's pipe (fd 3 in, fd 4 out)."""

    def __init__(self, browser: str, width: int, height: int) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # Chromium reads commands on fd 3 and writes replies on fd 4. Move the child's ends
        # above 10 first so that putting one on 3 cannot close the other.
        child_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._profile = tempfile.mkdtemp(prefix="kvtrace-shot-")

        def wire_fds() -> None:
            os.dup2(child_r, 3)  # dup2 clears close-on-exec: these two survive exec
            os.dup2(child_w, 4)

        self._proc = subprocess.Popen(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                "--mute-audio",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,  # every other descriptor here is close-on-exec already
            preexec_fn=wire_fds,
        )
        os.close(child_r)
        os.close(child_w)
        self._buffer = b""
        self._next_id = 0
        self._session: str | None = None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            # Events (console messages, exceptions) are passed over, except uncaught
            # exceptions, which are worth seeing when a page does not render.
            if reply.get("method") == "Runtime.exceptionThrown":
                details = reply["params"]["exceptionDetails"]
                print(
                    f"page exception: {details.get('text')} "
                    f"{details.get('exception', {}).get('description', '')[:300]}",
                    file=sys.stderr,
                )

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def close(self) -> None:
        try:
            self._session = None
            self.call("Browser.close")
        except RuntimeError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)
        shutil.rmtree(self._profile, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("output", help="the PNG to write")
    parser.add_argument("--size", default="1400x800", help="viewport WIDTHxHEIGHT")
    parser.add_argument(
        "--ready",
        default="document.readyState === 'complete'",
        help="JavaScript that is true once the page has rendered",
    )
    parser.add_argument(
        "--then", action="append", default=[], help="JavaScript to run once ready (repeatable, in order)"
    )
    parser.add_argument(
        "--settle-seconds", type=float, default=1.5, help="wait this long after ready and after each --then"
    )
    parser.add_argument("--timeout-seconds", type=float, default=60.0)
    parser.add_argument("--clip", help="X,Y,WIDTH,HEIGHT of the viewport to keep")
    parser.add_argument("--browser", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    width, height = (int(n) for n in args.size.split("x"))

    tools = DevTools(args.browser, width, height)
    try:
        tools.call("Page.navigate", url=args.url)
        deadline = time.monotonic() + args.timeout_seconds
        while not tools.evaluate(f"Boolean({args.ready})"):
            if time.monotonic() > deadline:
                print(f"{args.url}: not ready after {args.timeout_seconds:.0f} s ({args.ready})", file=sys.stderr)
                return 1
            time.sleep(0.25)
        time.sleep(args.settle_seconds)
        for script in args.then:
            tools.evaluate(script)
            time.sleep(args.settle_seconds)
        params: dict[str, Any] = {"format": "png"}
        if args.clip:
            x, y, w, h = (float(n) for n in args.clip.split(","))
            params["clip"] = {"x": x, "y": y, "width": w, "height": h, "scale": 1}
        png = base64.b64decode(tools.call("Page.captureScreenshot", **params)["data"])
    finally:
        tools.close()
    with open(args.output, "wb") as out:
        out.write(png)
    print(f"wrote {args.output} ({len(png) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
