"""A local stand-in for the Hugging Face Hub's HTTP API (standard library only), for download tests.

It speaks what huggingface_hub 2.4's ``snapshot_download`` and ``hf_hub_download`` ask for: the repo info
(``GET /api/{models,datasets}/ORG/NAME/revision/REV``: ``sha``, ``siblings``), the recursive tree listing
(``GET /api/.../tree/SHA``, where ``snapshot_download`` takes its file list from), and the files
(``HEAD``/``GET /[datasets/]ORG/NAME/resolve/REV/PATH``: ``X-Repo-Commit``, ``ETag``, ``Range``). It never
sends an ``X-Xet-*`` header or a redirect, so the client (hf_xet installed or not) uses plain HTTP, here.

Errors carry the Hub's ``X-Error-Code`` header, which is how the client picks its typed error:
``RepoNotFound`` (404) -> RepositoryNotFoundError, ``RevisionNotFound`` (404) -> RevisionNotFoundError,
``GatedRepo`` (401 without a token, 403 with a wrong one) -> GatedRepoError (a RepositoryNotFoundError
subclass: catch it first), ``EntryNotFound`` (404) -> RemoteEntryNotFoundError.

huggingface_hub reads ``HF_ENDPOINT`` once, at import, so set ``HF_ENDPOINT=server.url`` in the
environment of a subprocess, or pass ``endpoint=server.url`` to ``snapshot_download``/``hf_hub_download``.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Literal
from urllib.parse import parse_qs, unquote, urlsplit

# Files the Hub would keep in LFS (a repo's usual .gitattributes): their ETag is the sha256, as on the Hub.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".parquet", ".arrow", ".npy")
CHUNK = 16 * 1024
INFO = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?$")
RESOLVE = re.compile(r"^/(?:(datasets)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def git_blob_sha(data: bytes) -> str:
    """The git object id of a file, which the Hub reports as a file's ``oid`` and plain ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    """A repo served: its commit sha follows its content, so changing ``files`` makes a new commit."""

    kind: Literal["model", "dataset"]
    name: str
    files: dict[str, bytes]
    gated: bool = False
    branch: str = "main"

    @property
    def sha(self) -> str:
        """The 40-hex commit id: the one revision (besides ``branch``) the server resolves."""
        digest = hashlib.sha1(f"{self.kind}\0{self.name}\0".encode())
        for path in sorted(self.files):
            digest.update(f"{path}\0{git_blob_sha(self.files[path])}\0".encode())
        return digest.hexdigest()

    def is_lfs(self, path: str) -> bool:
        """Whether the Hub would store the file in LFS (by suffix, or 10 MiB and more)."""
        return path.endswith(LFS_SUFFIXES) or len(self.files[path]) >= 10 * 1024 * 1024

    def etag(self, path: str) -> str:
        """The ETag the client names the cached blob by (``blobs/ETAG``): sha256 for LFS, else the git oid."""
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(path) else git_blob_sha(data)

    def tree(self) -> list[dict[str, object]]:
        """The recursive tree listing, folders included, as ``GET /api/.../tree/REV?recursive=true`` gives it."""
        entries: list[dict[str, object]] = []
        folders = {"/".join(parts[:depth]) for parts in (p.split("/")[:-1] for p in self.files)
                   for depth in range(1, len(parts) + 1)}  # fmt: skip
        for folder in sorted(folders):
            oid = hashlib.sha1(f"tree\0{folder}".encode()).hexdigest()
            entries.append({"type": "directory", "oid": oid, "size": 0, "path": folder})
        for path in sorted(self.files):
            data = self.files[path]
            entry: dict[str, object] = {"type": "file", "oid": git_blob_sha(data), "size": len(data), "path": path}
            if self.is_lfs(path):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return entries


class HubServer:
    """The Hub on 127.0.0.1 (a free port, a thread), with faults that tests switch on by attribute.

    ``stall_after``: no file body byte at offset ``stall_after`` or beyond is ever sent; the response
    hangs there (the connection open) until the server stops. A resumed request (``Range``) past that
    point gets its headers and then nothing, so the client's read timeout fires on every attempt.
    ``die_after``: each file response is cut, the connection shut, after ``die_after`` body bytes of
    that response; a resumed request (``Range``) gets the next ``die_after`` bytes. Both are read when a
    response starts. huggingface_hub 2.4 keeps only whole 10 MiB chunks of a broken GET, so it resumes
    (``Range: bytes=10485760-``) only on files over 10 MiB with ``die_after`` over 10 MiB; otherwise each
    of its 6 attempts restarts at byte 0 and the call fails (httpx2.RemoteProtocolError or ReadTimeout).
    ``requests``: every request seen, as (method, path with query, headers with lower-case names).
    """

    def __init__(self, repos: list[HubRepo], *, token: str | None = None) -> None:
        self.repos = {(repo.kind, repo.name): repo for repo in repos}
        self.token = token
        self.stall_after: int | None = None
        self.die_after: int | None = None
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._stop = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False
        self._httpd.hub = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hubserver", daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    """One connection; HTTP/1.1 keep-alive, as the client's pooled connections expect."""

    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the tests read ``HubServer.requests`` instead."""

    def _handle(self) -> None:
        """Answer one request; a client that hung up mid-answer (it timed out) ends the connection quietly."""
        hub: HubServer = self.server.hub  # type: ignore[attr-defined]
        hub.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        try:
            self._route(hub)
        except ConnectionError:
            self.close_connection = True

    do_GET = do_HEAD = _handle

    def _route(self, hub: HubServer) -> None:
        split = urlsplit(self.path)
        if match := INFO.match(split.path):
            kind, name, what, rev, sub = match.groups()
            repo = self._find(hub, kind[:-1], name, unquote(rev) if rev else None)
            if repo is None:
                return
            if what == "tree":
                recursive = parse_qs(split.query).get("recursive", ["false"])[0].lower() == "true"
                prefix = unquote(sub or "/").strip("/")
                entries = [e for e in repo.tree() if _under(str(e["path"]), prefix, recursive)]
                return self._send(200, {"Content-Type": "application/json"}, json.dumps(entries).encode())
            info = {"id": repo.name, "sha": repo.sha, "private": False, "disabled": False, "tags": [],
                    "gated": "manual" if repo.gated else False, "lastModified": "2024-01-01T00:00:00.000Z",
                    "siblings": [{"rfilename": path} for path in sorted(repo.files)]}  # fmt: skip
            if repo.kind == "model":
                info["modelId"] = repo.name
            return self._send(200, {"Content-Type": "application/json"}, json.dumps(info).encode())
        if match := RESOLVE.match(split.path):
            kind, name, rev, path = match.groups()
            repo = self._find(hub, "dataset" if kind else "model", name, unquote(rev))
            if repo is not None and self._allowed(hub, repo):
                self._serve_file(hub, repo, unquote(path))
            return
        self._error(404, "", "Not found")

    def _find(self, hub: HubServer, kind: str, name: str, rev: str | None) -> HubRepo | None:
        """The repo if it is there at ``rev`` (its branch or full sha; None: its branch), else the error is sent."""
        repo = hub.repos.get((kind, name))
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        elif rev is not None and rev not in (repo.branch, repo.sha):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", repo)
        else:
            return repo
        return None

    def _allowed(self, hub: HubServer, repo: HubRepo) -> bool:
        """A gated repo's files need ``Authorization: Bearer TOKEN`` (with no server token, nobody gets them).

        Its info and tree stay public, as on the Hub, so the client fails at the first file's HEAD.
        """
        if not repo.gated:
            return True
        sent = self.headers.get("Authorization")
        if hub.token is not None and sent == f"Bearer {hub.token}":
            return True
        why = "You must be authenticated to access it." if sent is None else "You are not in the authorized list."
        self._error(401 if sent is None else 403, "GatedRepo", f"Access to {repo.name} is restricted. {why}", repo)
        return False

    def _serve_file(self, hub: HubServer, repo: HubRepo, path: str) -> None:
        if path not in repo.files:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {repo.branch}", repo)
        data = repo.files[path]
        start, end = 0, len(data) - 1
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   "ETag": f'"{repo.etag(path)}"', "X-Repo-Commit": repo.sha}  # fmt: skip
        if repo.is_lfs(path):
            headers |= {"X-Linked-Etag": headers["ETag"], "X-Linked-Size": str(len(data))}
        status = 200
        if (wanted := self.headers.get("Range")) is not None:
            match = RANGE.match(wanted.strip())
            first, last = match.groups() if match else ("", "")
            if first:
                start, end = int(first), min(int(last or end), end)
            elif last:
                start = max(len(data) - int(last), 0)
            if not (first or last) or start > end:
                return self._send(416, {**headers, "Content-Range": f"bytes */{len(data)}"}, b"")
            status, headers["Content-Range"] = 206, f"bytes {start}-{end}/{len(data)}"
        self._head(status, headers, end - start + 1)
        if self.command == "HEAD":
            return
        stall, die = hub.stall_after, hub.die_after
        cut = start + die if die is not None else None
        pos = start
        while pos <= end:
            if stall is not None and pos >= stall:
                hub._stop.wait()
                self.close_connection = True
                return
            if cut is not None and pos >= cut:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            stop = min(x for x in (end + 1, pos + CHUNK, stall, cut) if x is not None and x > pos)
            self.wfile.write(data[pos:stop])
            pos = stop

    def _error(self, status: int, code: str, message: str, repo: HubRepo | None = None) -> None:
        """An error as the Hub sends it: ``X-Error-Code``/``X-Error-Message`` and a JSON body."""
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if repo is not None and code != "RevisionNotFound":
            headers["X-Repo-Commit"] = repo.sha
        self._send(status, headers, json.dumps({"error": message}).encode())

    def _head(self, status: int, headers: dict[str, str], length: int) -> None:
        """The status line and headers; a Content-Length always, for keep-alive."""
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(length)}.items():
            self.send_header(key, value)
        self.end_headers()

    def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self._head(status, headers, len(body))
        if self.command != "HEAD":
            self.wfile.write(body)


def _under(path: str, prefix: str, recursive: bool) -> bool:
    """Whether a tree entry is listed for folder ``prefix`` (its direct children unless ``recursive``)."""
    if prefix and not path.startswith(prefix + "/"):
        return False
    rest = path[len(prefix) + 1 :] if prefix else path
    return recursive or "/" not in rest
