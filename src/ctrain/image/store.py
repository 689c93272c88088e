"""Where a built image lives, how to find it by reference, and how to export it as an OCI layout.

Two stores hold OCI images: the Docker daemon and containers-storage (shared by podman and
buildah). An image is addressed by its ID (the sha256 of its config) once found, so later steps
use exactly that image even if the tag moves.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ctrain import proc
from ctrain.errors import CommandError, CtrainError, ParseError

StoreName = Literal["docker", "containers", "sif"]
_HEX64 = re.compile(r"^(sha256:)?([0-9a-f]{64})$")


@dataclass(frozen=True)
class Image:
    """A built image: the reference it was asked for by, its ID and where it lives."""

    ref: str
    id: str  # "sha256:<hex>": digest of the image config, stable across push and pull
    store: StoreName
    digest: str | None = None  # manifest digest in the store, when it has one
    path: Path | None = None  # the file, for a SIF built by Apptainer
    size: int | None = None  # bytes, uncompressed, when the store says

    @property
    def short_id(self) -> str:
        return self.id.removeprefix("sha256:")[:12]

    @property
    def source(self) -> str:
        """The image as a skopeo/containers-image source, pinned by ID."""
        hex_id = self.id.removeprefix("sha256:")
        if self.store == "docker":
            return f"docker-daemon:sha256:{hex_id}"
        if self.store == "containers":
            return f"containers-storage:{hex_id}"
        raise CtrainError(f"{self.ref} is a SIF file, not an OCI image")


def normalise_id(value: str) -> str:
    """``sha256:<hex>`` from an image ID in any of the forms the tools print."""
    match = _HEX64.match(value.strip())
    if not match:
        raise ParseError("an image ID", value)
    return "sha256:" + match.group(2)


def docker_daemon_up() -> bool:
    """Whether a Docker daemon answers (the ``docker`` binary alone may be just a client)."""
    if not proc.which("docker"):
        return False
    try:
        result = proc.run(["docker", "version", "--format", "{{.Server.Version}}"], check=False, timeout=20)
    except CtrainError:
        return False
    return result.returncode == 0 and bool(result.stdout.strip())


def _containers_tool() -> str | None:
    return next((t for t in ("podman", "buildah") if proc.which(t)), None)


def inspect(ref: str, store: StoreName) -> Image | None:
    """The image ``ref`` in ``store``, or None when the store does not have it."""
    if store == "docker":
        if not docker_daemon_up():
            return None
        result = proc.run(["docker", "image", "inspect", ref], check=False)
        if result.returncode != 0:
            return None
        data = _json(result.stdout, f"docker image inspect {ref}")[0]
        digests = data.get("RepoDigests") or []
        digest = digests[0].split("@", 1)[1] if digests else None
        return Image(ref, normalise_id(data["Id"]), "docker", digest, size=_int(data.get("Size")))
    if store == "containers":
        tool = _containers_tool()
        if tool is None:
            return None
        if tool == "podman":
            result = proc.run(["podman", "image", "inspect", ref], check=False)
            if result.returncode != 0:
                return None
            data = _json(result.stdout, f"podman image inspect {ref}")[0]
            return Image(
                ref, normalise_id(data["Id"]), "containers", data.get("Digest") or None, size=_int(data.get("Size"))
            )
        result = proc.run(["buildah", "inspect", "--type", "image", ref], check=False)
        if result.returncode != 0:
            return None
        data = _json(result.stdout, f"buildah inspect {ref}")
        return Image(ref, normalise_id(data["FromImageID"]), "containers", data.get("FromImageDigest") or None,
                     size=_manifest_size(data.get("Manifest")))  # fmt: skip
    raise ValueError(store)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and value > 0 else None


def _manifest_size(manifest: Any) -> int | None:
    """The layers' sizes in a manifest (buildah's inspect has no image size): uncompressed for
    images built here, compressed for pulled ones."""
    try:
        layers = json.loads(manifest)["layers"] if isinstance(manifest, str) else None
        return _int(sum(int(layer["size"]) for layer in layers)) if layers else None
    except (ValueError, KeyError, TypeError):
        return None


def stores_for(builder: str) -> tuple[StoreName, ...]:
    """The stores a builder writes to (``auto``: all, Docker first)."""
    return {
        "docker": ("docker",),
        "podman": ("containers",),
        "buildah": ("containers",),
        "auto": ("docker", "containers"),
    }.get(builder, ())


def locate(ref: str, builder: str = "auto") -> Image:
    """Find ``ref`` in the store(s) its builder uses; a clear error when no store has it."""
    stores = stores_for(builder)
    for store in stores:
        image = inspect(ref, store)
        if image is not None:
            return image
    where = " or ".join({"docker": "the Docker daemon", "containers": "containers-storage"}[s] for s in stores)
    raise CtrainError(f"image {ref} not found in {where or 'any image store'}; build it first (ctrain build)")


def export_oci(image: Image, layout: Path, tag: str = "image") -> None:
    """Write ``image`` as an OCI layout directory (uncompressed layers: fast, local use only)."""
    proc.require("skopeo")
    proc.run(
        ["skopeo", "copy", "--quiet", "--dest-oci-accept-uncompressed-layers", image.source, f"oci:{layout}:{tag}"]
    )


def _blob(layout: Path, digest: str) -> bytes:
    algo, _, hex_digest = digest.partition(":")
    return (layout / "blobs" / algo / hex_digest).read_bytes()


def oci_config(layout: Path) -> dict[str, Any]:
    """The image config (Env, Entrypoint, Cmd, WorkingDir, Volumes, Labels, ...) of a one-image layout."""
    index = _json((layout / "index.json").read_text(), f"{layout}/index.json")
    manifests = index.get("manifests") or []
    if len(manifests) != 1:
        raise ParseError(f"{layout}/index.json (expected exactly one image)", json.dumps(index))
    manifest = _json(_blob(layout, manifests[0]["digest"]).decode(), "the image manifest")
    return _json(_blob(layout, manifest["config"]["digest"]).decode(), "the image config")


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParseError(what, text) from exc


__all__ = ["CommandError", "Image", "docker_daemon_up", "export_oci", "inspect", "locate", "oci_config"]
