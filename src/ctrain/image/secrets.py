"""Credentials for private package indexes, kept out of the image.

A setting such as ``image.torch_index: https://user:PASS@host/simple`` is split in two: the URL
without its user and password goes to the build as an argument (it may be recorded in the image's
history or definition: it holds nothing secret), and the credentials go into a netrc file that
exists only while the build runs, in a private temporary directory. The builder mounts that file
for the install step only (``--secret`` for docker/podman/buildah, a read-only ``--bind`` for
Apptainer) at :data:`MOUNT_PATH`, where containers/install.sh points pip at it (``NETRC``). So
no password is in an image layer, its history, a SIF's embedded definition, or a command line.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from ctrain.errors import ConfigError

SECRET_ID = "ctrain-netrc"  # the build secret's id, and the file's name in MOUNT_DIR
MOUNT_DIR = "/run/secrets"  # where builders put secrets (BuildKit's and buildah's default)
MOUNT_PATH = f"{MOUNT_DIR}/{SECRET_ID}"
# A netrc is whitespace-separated and newer Pythons read '"' and '\' as quoting.
_UNSAFE = re.compile(r"[\s\"\\]")


@dataclass(frozen=True)
class Credential:
    """A login for one host, as a netrc ``machine`` entry holds it."""

    host: str
    login: str
    password: str = ""


def split_url(url: str, setting: str = "URL") -> tuple[str, Credential | None]:
    """``url`` without ``user:password@``, and that user and password (percent-decoded), if any."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return url, None
    login, _, password = (unquote(p) for p in userinfo.partition(":"))
    host = hostport.split(":", 1)[0]  # as pip (requests) looks a host up in a netrc: no port
    if not host or not login:
        raise ConfigError(f"{setting}: give user and password as https://USER:PASSWORD@HOST/...")
    if _UNSAFE.search(login) or _UNSAFE.search(password):
        raise ConfigError(
            f"{setting}: the user or password holds whitespace, '\"' or '\\', which a netrc file (how "
            "ctrain passes index credentials to pip) cannot carry; use a token without them"
        )
    return urlunsplit(parts._replace(netloc=hostport)), Credential(host, login, password)


def split_urls(urls: Mapping[str, str | None]) -> tuple[dict[str, str | None], list[Credential]]:
    """Every URL (keyed by the setting it comes from) without credentials, and the credentials:
    at most one login per host, since a netrc holds one."""
    clean: dict[str, str | None] = {}
    found: dict[str, Credential] = {}
    for setting, url in urls.items():
        if url is None:
            clean[setting] = None
            continue
        clean[setting], cred = split_url(url, setting)
        if cred is None:
            continue
        if found.get(cred.host, cred) != cred:
            raise ConfigError(f"{setting}: a second login for {cred.host}; one host can have one login")
        found[cred.host] = cred
    return clean, list(found.values())


def netrc_text(credentials: Sequence[Credential]) -> str:
    lines = []
    for cred in credentials:
        password = f" password {cred.password}" if cred.password else ""
        lines.append(f"machine {cred.host} login {cred.login}{password}\n")
    return "".join(lines)


@contextlib.contextmanager
def netrc_file(credentials: Sequence[Credential]) -> Iterator[Path | None]:
    """A netrc with ``credentials`` for as long as the block runs (None when there are none): in a
    fresh directory only this user can enter (0700), the file 0600; both removed afterwards, also
    when the block fails."""
    if not credentials:
        yield None
        return
    directory = Path(tempfile.mkdtemp(prefix="ctrain-secrets-"))
    try:
        path = directory / SECRET_ID
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(netrc_text(credentials))
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


__all__ = ["MOUNT_DIR", "MOUNT_PATH", "SECRET_ID", "Credential", "netrc_file", "split_url", "split_urls"]
