"""A screenshot of the `landmark-memory serve` page once an answer is shown, in headless
Chromium driven through its DevTools protocol (Debian's `chromium` package; `pip install
websocket-client`).

    landmark-memory serve my-memory --model smollm2-landmark &
    python experiments/screenshot_page.py "http://127.0.0.1:8000/?q=Where was the author born?" page.png --wait 25

The page asks the question in ``?q=`` as soon as it loads; ``--wait`` seconds later (the answer
streamed in, its passages and strips drawn) the screenshot is taken.
"""

import argparse
import base64
import json
import subprocess
import time
import urllib.request

import websocket

PORT = 9333


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("out", help="the PNG to write")
    ap.add_argument("--wait", type=float, default=10.0, help="seconds between loading and the screenshot")
    ap.add_argument("--size", default="1000,1250", help="window width,height")
    args = ap.parse_args()
    proc = subprocess.Popen(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             f"--window-size={args.size}", f"--remote-debugging-port={PORT}",
                             "--remote-allow-origins=*", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                tabs = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{PORT}/json").read())
                break
            except OSError:
                time.sleep(0.2)
        page = next(t for t in tabs if t["type"] == "page")
        ws = websocket.create_connection(page["webSocketDebuggerUrl"], suppress_origin=True)
        calls = 0

        def call(method, **params):
            nonlocal calls
            calls += 1
            ws.send(json.dumps({"id": calls, "method": method, "params": params}))
            while True:
                msg = json.loads(ws.recv())
                if msg.get("id") == calls:
                    return msg.get("result", {})

        call("Page.enable")
        call("Page.navigate", url=args.url)
        time.sleep(args.wait)
        with open(args.out, "wb") as f:
            f.write(base64.b64decode(call("Page.captureScreenshot", format="png")["data"]))
        ws.close()
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
