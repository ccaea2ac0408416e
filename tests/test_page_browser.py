"""The page in a real browser (headless Chromium): a model's name or a document's text never runs
as script or shows reversed, and the page's Content-Security-Policy alone stops an inline script
that escaping let through. Needs Chromium (Debian: ``apt-get install chromium``; ``.ci/run``
installs it)."""

import http.server
import shutil
import subprocess
import threading
from importlib import resources

import pytest

from landmark_memory.app import serve_routes
from landmark_memory.app.cli import main
from landmark_memory.models.model import BUNDLED_MODEL
from landmark_memory.training.data import SAMPLE_DIR

pytestmark = pytest.mark.slow  # a server and a browser in processes of their own

RAN = "document.documentElement.dataset.ran='y'+'es'"  # what an injected script would do
HOSTILE_NAME = f"m</script><script>{RAN}</script>"  # a model folder's path ends the page's script
BIDI = "report\u202eexe.txt"


def browser() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert found, "these tests need a headless Chromium: apt-get install chromium (.ci/run installs it)"
    return found


def rendered(url: str, tmp_path) -> str:
    """The page at ``url`` as the browser holds it once its scripts ran (its DOM, serialized)."""
    out = subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "</html>" in out.stdout, out.stderr[-2000:]
    return out.stdout


def test_a_hostile_model_name_and_document_show_as_text_in_the_page(tmp_path, serving):
    model = tmp_path.joinpath(*HOSTILE_NAME.split("/"))
    shutil.copytree(BUNDLED_MODEL, model)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / BIDI).write_text("\x1b]0;owned\x07 " + (SAMPLE_DIR / "val" / "alice_excerpt.txt").read_text()[:600])
    assert main(["build", str(tmp_path / "mem"), "--input", str(docs), "--model", str(model), "--quiet"]) == 0
    with serving(tmp_path / "mem", "--model", str(model)) as url:
        dom = rendered(url + "/", tmp_path)
    assert 'data-ran="yes"' not in dom, "the model's name ran as script"
    assert "document(s), model " in dom, "the page's own script did not run"
    assert "m&lt;/script&gt;&lt;script&gt;" in dom  # the name, shown as text
    assert "report\\u202eexe.txt" in dom and "\u202e" not in dom


def _served_once(html: str, policy: str | None):
    """A plain HTTP server of ``html`` (with ``policy`` as its Content-Security-Policy), 404 elsewhere."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            if policy:
                self.send_header("Content-Security-Policy", policy)
            self.end_headers()
            self.wfile.write(html.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("with_policy", [True, False])
def test_the_policy_alone_stops_a_script_that_escaping_let_in(tmp_path, monkeypatch, with_policy):
    monkeypatch.setattr(serve_routes, "script_json", lambda value: f'"{value}"')  # the slip: no escaping at all
    page = serve_routes.render_page(resources.files("landmark_memory").joinpath("assets/page.html").read_text(),
                                    HOSTILE_NAME)
    server = _served_once(page.html, page.policy if with_policy else None)
    try:
        dom = rendered(f"http://127.0.0.1:{server.server_address[1]}/", tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert ('data-ran="yes"' in dom) == (not with_policy)  # without the policy the slip runs: the test can fail
