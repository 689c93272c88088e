#!/bin/sh
# The install steps of the training image, shared by containers/Dockerfile and the standalone
# Apptainer definition (containers/ctrain-standalone.def), so both images hold the same packages
# at the same versions.
#
#   install.sh deps FLAVOUR DIR   the pinned stack (DIR has requirements.txt and constraints.txt)
#                                 into /opt/ctrain/venv
#   install.sh ctrain SRC         ctrain itself from the source tree SRC (no dependencies)
#
# The pins in effect end up in /opt/ctrain/pins.txt, which check.py verifies.
#
# FLAVOUR gpu keeps what the base image ships (NGC PyTorch: its CUDA torch, numpy, ...): pins for
# packages the base already has are dropped. FLAVOUR cpu installs everything from the pins, torch
# as the CPU build. A non-empty /wheelhouse makes the build air-gapped: pip installs from it only.
# A private index's login comes as a netrc at /run/secrets/ctrain-netrc, mounted for this step only
# (never part of the image); pip reads it through NETRC, so no URL or argument holds a password.
set -eu
umask 022
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
venv=/opt/ctrain/venv
python="$venv/bin/python"

offline() { [ -d /wheelhouse ] && [ -n "$(ls -A /wheelhouse)" ]; }
netrc=/run/secrets/ctrain-netrc

deps() {
    flavour=$1 dir=$2
    case "$flavour" in
        gpu) python3 -c 'import torch' 2>/dev/null || {
                 echo "install.sh: FLAVOUR=gpu needs a base image with a CUDA build of torch" \
                      "(e.g. NGC PyTorch); use FLAVOUR=cpu on a plain base" >&2; exit 2; } ;;
        cpu) ;;
        *) echo "install.sh: FLAVOUR must be gpu or cpu, not '$flavour'" >&2; exit 2 ;;
    esac
    python3 -m venv --system-site-packages "$venv"
    constraints=/tmp/ctrain-constraints.txt
    if [ "$flavour" = gpu ]; then
        # Drop the pins of whatever the base's Python already has.
        python3 - "$dir/constraints.txt" >"$constraints" <<'PY'
import importlib.metadata as md, re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
have = {norm(d.metadata["Name"]) for d in md.distributions() if d.metadata["Name"]}
for line in open(sys.argv[1]):
    name = re.split(r"[=<>!~;\[ ]", line.strip(), maxsplit=1)[0]
    if name and not line.startswith("#") and norm(name) in have:
        print(f"# kept from the base image: {line.strip()}")
    else:
        print(line, end="")
PY
    else
        cp "$dir/constraints.txt" "$constraints"
    fi
    if [ -s "$netrc" ]; then
        export NETRC="$netrc"
        echo "install.sh: index credentials from $netrc (a build secret)"
    fi
    if offline; then
        echo "install.sh: air-gapped install from /wheelhouse ($(ls /wheelhouse | wc -l) files)"
        set -- --no-index --find-links /wheelhouse
    elif [ "$flavour" = cpu ] && [ "${TORCH_INDEX_URL:-}" != none ]; then
        set -- --extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
    else
        set --
    fi
    grep -v -E '^(deepspeed|#|$)' "$dir/requirements.txt" >/tmp/ctrain-requirements.txt
    "$python" -m pip install "$@" -c "$constraints" -r /tmp/ctrain-requirements.txt
    # deepspeed's sdist imports torch while building: build it against the torch just installed.
    "$python" -m pip install "$@" --no-build-isolation -c "$constraints" deepspeed
    "$python" -m pip check
    # What this image is pinned to; check.py (and Apptainer's %test) verify against it.
    mv "$constraints" /opt/ctrain/pins.txt
    rm -f /tmp/ctrain-requirements.txt
    chmod -R a+rX /opt/ctrain
}

ctrain() {
    src=$1
    "$python" -m pip install --no-deps --no-build-isolation --no-index "$src"
    rm -rf "$src/build" "$src"/src/*.egg-info
    # enroot (pyxis) starts a container through a login shell, and Debian's /etc/profile then resets
    # a non-root user's PATH, dropping the venv that the image's PATH puts first: put it back.
    cat >/etc/profile.d/ctrain-venv.sh <<EOF
case ":\$PATH:" in *":$venv/bin:"*) ;; *) PATH="$venv/bin:\$PATH"; export PATH ;; esac
EOF
    "$venv/bin/ctrain" --version
    # What the image is (ctrain's, torch's and CUDA's versions, the oldest driver CUDA runs on), in
    # the image for ctrain convert and submit to read (ctrain.image.facts).
    "$python" -m ctrain.image.facts >/opt/ctrain/image.json
    chmod a+r /opt/ctrain/image.json
    cat /opt/ctrain/image.json
}

step=${1:-}
[ "$#" -gt 0 ] && shift
case "$step" in
    deps) [ "$#" -eq 2 ] || { echo "usage: install.sh deps gpu|cpu DIR" >&2; exit 2; }; deps "$@" ;;
    ctrain) [ "$#" -eq 1 ] || { echo "usage: install.sh ctrain SRC" >&2; exit 2; }; ctrain "$@" ;;
    *) echo "usage: install.sh deps gpu|cpu DIR | install.sh ctrain SRC" >&2; exit 2 ;;
esac
