"""Image references as registries spell them, ``[HOST[:PORT]/]PATH[:TAG][@DIGEST]``, checked before
any tool sees one: skopeo, buildah and enroot refuse a malformed reference only after seconds of
retries, with "invalid reference format" and no word on what a valid one looks like.

The grammar is the Docker distribution's (github.com/distribution/reference): a host is a domain
name, IPv4 or [IPv6] address with an optional port; path components are lowercase letters and
digits joined by ``.``, ``_``, ``__`` or dashes; a tag is ``[\\w][\\w.-]{0,127}``; a digest is
``ALGORITHM:HEX``. The first component is the host only when it has a ``.`` or ``:`` or is
``localhost``; otherwise the reference names an image on Docker Hub.

Also here: enroot's spelling of the same reference (``nvcr.io#nvidia/pytorch:24.10-py3``), which
pyxis hands to ``enroot import docker://...``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ctrain.errors import ConfigError

EXAMPLE = "ghcr.io/team/ctrain:1.0"
FORM = "[HOST[:PORT]/]PATH[:TAG][@sha256:DIGEST], the path in lowercase letters, digits and . _ -"
_NAME_MAX = 255

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
DOMAIN = re.compile(rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::(?P<port>[0-9]+))?")
PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
TAG = re.compile(r"[\w][\w.-]{0,127}")
DIGEST = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Docker Hub's names for itself: enroot and pyxis reach it without one.
DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")


@dataclass(frozen=True)
class Reference:
    """A parsed reference; ``domain`` None means Docker Hub."""

    domain: str | None
    path: str
    tag: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        return f"{self.domain}/{self.path}" if self.domain else self.path

    def __str__(self) -> str:
        return self.name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")


def is_domain(component: str) -> bool:
    """Whether the first path component of a reference names a registry host (Docker's rule)."""
    return "." in component or ":" in component or component == "localhost"


def scheme(text: str) -> str | None:
    """``docker`` for ``docker://...``; None when ``text`` has no ``SCHEME://``."""
    match = _SCHEME.match(text)
    return match.group(1) if match else None


def _split(text: str) -> tuple[str | None, str, str | None, str | None]:
    """(domain, path, tag, digest) of ``text``, unchecked; an empty tag or digest is "" (given
    but empty), an absent one None."""
    rest, at, digest = text.partition("@")
    first, slash, remainder = rest.partition("/")
    domain = first if slash and is_domain(first) else None
    path = remainder if domain is not None else rest
    tag = None
    if ":" in path.rsplit("/", 1)[-1]:
        path, _, tag = path.rpartition(":")
    return domain, path, tag, digest if at else None


def problem(text: str, *, tag: bool = True, digest: bool = True) -> str | None:
    """What is wrong with ``text`` as a reference, or None when it is a valid one."""
    if not text:
        return "it is empty"
    if any(c.isspace() for c in text):
        return "it contains a space"
    if scheme(text):
        return f"drop {scheme(text)}:// (a reference has no scheme)"
    domain, path, found_tag, found_digest = _split(text)
    if domain is not None:
        match = DOMAIN.fullmatch(domain)
        if not match:
            return f"{domain!r} is not a registry host (HOST or HOST:PORT)"
        if match.group("port") is not None and not 0 < int(match.group("port")) < 65536:
            return f"the port in {domain!r} is not a port number (1-65535)"
    if not path:
        return "it names no image"
    for component in path.split("/"):
        if not component:
            return "it has an empty path component ('//', or '/' at an end)"
        if not PATH_COMPONENT.fullmatch(component):
            if PATH_COMPONENT.fullmatch(component.lower()):
                return f"{component!r}: repository names must be lowercase"
            return f"{component!r}: path components are lowercase letters and digits joined by . _ or -"
    if len(path) + len(domain or "") + 1 > _NAME_MAX:
        return f"the name is longer than {_NAME_MAX} characters"
    if found_tag is not None:
        if not found_tag:
            return "a ':' with no tag after it"
        if not tag:
            return f"a tag (:{found_tag}) does not belong here"
        if not TAG.fullmatch(found_tag):
            return f"the tag {found_tag!r} is not valid (up to 128 letters, digits, _ . -, not starting with . or -)"
    if found_digest is not None:
        if not found_digest:
            return "an '@' with no digest after it"
        if not digest:
            return f"a digest (@{found_digest}) does not belong here"
        if not DIGEST.fullmatch(found_digest):
            return f"the digest {found_digest!r} is not ALGORITHM:HEX (e.g. sha256: and 64 hex digits)"
    return None


def parse(text: str, what: str = "image reference", *, example: str = EXAMPLE, tag: bool = True,
          digest: bool = True) -> Reference:  # fmt: skip
    """``text`` as a :class:`Reference`; a :class:`ConfigError` naming ``what`` and a valid example otherwise."""
    reason = problem(text, tag=tag, digest=digest)
    if reason:
        raise ConfigError(f"{what} {text!r} is not a valid image reference: {reason}; write it like {example} ({FORM})")
    domain, path, found_tag, found_digest = _split(text)
    return Reference(domain, path, found_tag, found_digest)


def enroot(text: str, what: str = "image") -> str:
    """The reference as enroot spells it for pyxis: ``[USER@][REGISTRY#]IMAGE[:TAG]``.

    ``nvcr.io/nvidia/pytorch:24.10-py3`` becomes ``nvcr.io#nvidia/pytorch:24.10-py3``; Docker Hub
    needs no registry (``docker.io/library/ubuntu:22.04`` becomes ``ubuntu:22.04``); a ``docker://``
    prefix is dropped (pyxis adds its own); references already in enroot's form, and pyxis's
    ``dockerd://``/``podman://`` images, stay as they are. The same conversion, without the checks,
    is ``ctrain_enroot_image`` in sbatch/lib/ctrain.sh.
    """
    found = scheme(text)
    if found in ("dockerd", "podman"):
        return text
    if found not in (None, "docker"):
        raise ConfigError(
            f"{what} {text!r}: pyxis imports images from Docker registries only (no {found}://): give "
            "HOST/PATH:TAG (e.g. nvcr.io/nvidia/pytorch:24.10-py3) or an enroot squashfs file (.sqsh)"
        )
    ref = text.removeprefix("docker://")
    if "#" in ref:
        user_registry, _, image = ref.partition("#")
        registry = user_registry.rpartition("@")[2]
        if not DOMAIN.fullmatch(registry) or "/" in user_registry:
            raise ConfigError(
                f"{what} {text!r}: {registry!r} before '#' is not a registry host; enroot's form is "
                "[USER@]REGISTRY#IMAGE[:TAG], e.g. nvcr.io#nvidia/pytorch:24.10-py3"
            )
        parse(image, what=f"{what} {text!r}: the part after '#',", example="nvcr.io#nvidia/pytorch:24.10-py3")
        if is_domain(image.split("/", 1)[0]) and "/" in image:
            raise ConfigError(f"{what} {text!r} names two registries; write it like nvcr.io#nvidia/pytorch:24.10-py3")
        return ref
    parsed = parse(ref, what=what, example="nvcr.io/nvidia/pytorch:24.10-py3")
    suffix = (f":{parsed.tag}" if parsed.tag else "") + (f"@{parsed.digest}" if parsed.digest else "")
    if parsed.domain is None:
        return parsed.path + suffix
    if parsed.domain in DOCKER_HUB:
        return parsed.path.removeprefix("library/") + suffix
    return f"{parsed.domain}#{parsed.path}{suffix}"
