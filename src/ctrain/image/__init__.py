"""The training image: build it (``build``), turn it into a SIF or an enroot squashfs
(``convert``, ``sqsh``) and put it where a cluster can reach it (``push``).

The image lives in one of three stores: the Docker daemon, containers-storage (podman and
buildah share it) or, when Apptainer built it, a SIF file. Everything downstream of the build
addresses an image by its ID (the digest of its config), so a conversion or push acts on exactly
the image that was built, whatever tag has moved since.
"""
