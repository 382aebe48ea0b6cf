"""A real browser for the tests: TensorBoard on 127.0.0.1 and headless Chromium looking at it.

```python
from browser import chromium_or_skip, page_text, screenshot, tensorboard
with tensorboard(log_dir) as base_url:
    text = page_text(chromium_or_skip(), f"{base_url}/#scalars")
```

Chromium is Debian's `chromium` (`scripts/bootstrap.sh --with-browser` installs it). When it is missing or cannot
start, `chromium_or_skip()` skips the test and prints why; it never lets a test pass unchecked.
"""

import contextlib
import gzip
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import BIN, free_port

# Headless, as root in a container (no sandbox), no GPU, no first-run or network side trips.
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-extensions", "--disable-background-networking", "--hide-scrollbars", "--mute-audio"]


def chromium_or_skip():
    """The chromium command, checked to start; otherwise skip, printing the reason."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    reason = None
    if binary is None:
        reason = "chromium is not installed (scripts/bootstrap.sh --with-browser installs Debian's chromium)"
    else:
        try:
            out = subprocess.run([binary, *FLAGS, "--dump-dom", "data:text/html,<p>ok</p>"],
                                 capture_output=True, text=True, timeout=60)
            if "<p>ok</p>" not in out.stdout:
                reason = f"chromium ({binary}) did not start: exit {out.returncode}, {out.stderr.strip()[-500:]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            reason = f"chromium ({binary}) did not start: {e}"
    if reason:
        print(f"SKIPPED: {reason}", file=sys.stderr)
        pytest.skip(reason)
    return binary


@contextlib.contextmanager
def tensorboard(log_dir, timeout=90):
    """Run TensorBoard on 127.0.0.1 on a free port; yields its base URL once it answers."""
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([str(BIN / "tensorboard"), "--logdir", str(log_dir), "--host", "127.0.0.1",
                             "--port", str(port), "--load_fast", "false"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{base}/data/plugins_listing", timeout=5) as response:
                    if b"profile" in response.read():
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise AssertionError(f"TensorBoard on port {port} did not come up:\n{log.read().decode()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def get_json(url):
    with urllib.request.urlopen(url, timeout=60) as response:
        data = response.read()
        if response.headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
    return json.loads(data)


def dump_dom(chromium, url, budget_ms=20000, timeout=120):
    """The page's DOM after `budget_ms` of virtual time (scripts ran, data fetched, rendered)."""
    out = subprocess.run([chromium, *FLAGS, f"--virtual-time-budget={budget_ms}", "--window-size=1400,1000",
                          "--dump-dom", url], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and out.stdout, f"chromium --dump-dom {url}: exit {out.returncode}\n{out.stderr[-2000:]}"
    return out.stdout


def page_text(chromium, url, **kwargs):
    """The visible text of the page, one space between words (scripts and styles removed)."""
    dom = dump_dom(chromium, url, **kwargs)
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom))).strip()


def screenshot(chromium, url, path, budget_ms=20000, size="1400,1000", timeout=120):
    """Save a PNG of the page after `budget_ms` of virtual time."""
    out = subprocess.run([chromium, *FLAGS, f"--virtual-time-budget={budget_ms}", f"--window-size={size}",
                          f"--screenshot={path}", url], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and Path(path).is_file(), f"chromium --screenshot {url}: {out.stderr[-2000:]}"
    return Path(path)
