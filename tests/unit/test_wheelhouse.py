"""``ctrain wheelhouse`` logs pip in to a private index without putting the password on pip's
command line: a real pip against a local index that refuses requests without the login."""

from __future__ import annotations

import base64
import io
import sys
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ctrain import proc
from ctrain.errors import CommandError, ConfigError
from ctrain.image.wheelhouse import index_access

LOGIN, TOKEN = "ci-user", "S3CRET-token"
WHEEL = "ctrain_probe-1.0-py3-none-any.whl"


def _wheel() -> bytes:
    """The smallest wheel pip downloads: a name, a version, metadata."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        info = "ctrain_probe-1.0.dist-info"
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: ctrain-probe\nVersion: 1.0\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return buffer.getvalue()


@pytest.fixture()
def private_index() -> Iterator[tuple[str, list[str]]]:
    """A PEP 503 index on localhost that answers 401 without the login; yields its URL and the
    Authorization headers it received."""
    expected = "Basic " + base64.b64encode(f"{LOGIN}:{TOKEN}".encode()).decode()
    seen: list[str] = []
    wheel = _wheel()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            seen.append(self.headers.get("Authorization", ""))
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="index"')
                self.end_headers()
                return
            if self.path.rstrip("/") == "/simple/ctrain-probe":
                body, kind = f'<a href="/files/{WHEEL}">{WHEEL}</a>'.encode(), "text/html"
            elif self.path == f"/files/{WHEEL}":
                body, kind = wheel, "application/octet-stream"
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", seen
    finally:
        server.shutdown()
        server.server_close()


def _pip_download(index: list[str], env: dict[str, str] | None, into: Path) -> None:
    proc.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--no-cache-dir",
         "--disable-pip-version-check", *index, "-d", into, "ctrain-probe"],
        env=env,
    )  # fmt: skip


def test_the_login_reaches_pip_through_a_netrc_not_its_command_line(
    private_index: tuple[str, list[str]], tmp_path: Path
) -> None:
    url, seen = private_index
    with_login = url.replace("http://", f"http://{LOGIN}:{TOKEN}@")
    with index_access(with_login) as (index, env):
        assert index == ["--extra-index-url", url]  # what ps would show: no login
        assert env is not None and TOKEN in Path(env["NETRC"]).read_text()
        # --index-url replaces PyPI: the private index is the only place pip looks.
        _pip_download(["--index-url", url], env, tmp_path)
        netrc = Path(env["NETRC"])
    assert (tmp_path / WHEEL).is_file()
    assert seen and all(h.startswith("Basic ") for h in seen[-2:])
    assert not netrc.exists() and not netrc.parent.exists()  # gone once pip is done


def test_without_the_login_the_index_refuses(private_index: tuple[str, list[str]], tmp_path: Path) -> None:
    """The index really needs the login, so the test above can fail."""
    url, _ = private_index
    with index_access(url) as (index, env):
        assert env is None
        with pytest.raises(CommandError):
            _pip_download(["--index-url", url], env, tmp_path)
    assert not (tmp_path / WHEEL).exists()


def test_a_login_a_netrc_cannot_hold_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="image.torch_index"):
        with index_access("https://user:has space@host/simple"):
            pass
