#!/usr/bin/env bash
# Download what scripts/gpu-testbed.sh installs on a GPU machine that has no package registry:
#   debs/      Slurm, munge, squashfuse, fuse2fs, squashfs-tools, iproute2, procps, debootstrap and
#              every library they need that an Ubuntu 24.04 base lacks (from Ubuntu's archive), with
#              a Packages index, so `apt-get` on the GPU machine installs them offline and resolves
#              their dependencies against what that machine already has
#   apptainer/ Apptainer (Debian's package: Ubuntu 24.04 has none; it needs glibc >= 2.38, which
#              Ubuntu 24.04 has)
#   wheels/    ctrain's wheel and the training stack's Python wheels that the GPU machine's PyTorch
#              environment lacks or holds in other versions (pins from containers/constraints.txt)
#   bench-wheels/  the 8B benchmark's baselines: Liger, DeepSpeed and their imports
#
#   scripts/gpu-bundle.sh [OUT]        (default .gpu/bundle; OUT/README says what is in it)
#
# Run it where Ubuntu's archive, Debian's archive and PyPI are reachable (any Debian or Ubuntu with
# apt-get, dpkg-dev and python3 with pip). Nothing is installed here: apt runs against its own state
# directory, and the packages are only downloaded. About 45 MB.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-$repo/.gpu/bundle}")
work=${CTRAIN_BUNDLE_CACHE:-/var/tmp/ctrain-gpu-bundle} # apt state and lists, kept between runs
python=${PYTHON:-python3}
ubuntu=${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
ubuntu_security=${UBUNTU_SECURITY_MIRROR:-http://security.ubuntu.com/ubuntu}
debian=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=noble # the GPU machines' OS (Ubuntu 24.04); gpu-testbed.sh checks it

# What the testbed needs on the GPU machine (ctrain.system.PACKAGES "testbed" and "apptainer"), and
# what Debian's Apptainer package needs that is in Ubuntu's archive.
packages=(slurm-wlm munge squashfs-tools iproute2 util-linux procps debootstrap squashfuse fuse2fs
          uidmap libseccomp2 libsqlite3-0 ca-certificates)
# Python packages pinned in containers/constraints.txt that the GPU machine's environment (PyTorch
# 2.11, transformers 5.17, accelerate 1.15, huggingface-hub 1.33, tokenizers 0.23.2; no TRL, no
# datasets) lacks or holds in a version the training stack cannot use. What it has in versions the
# stack accepts (huggingface-hub, tokenizers, pyarrow, ...) is used as it is: the transfer is small.
wheels=(transformers trl datasets dill multiprocess fsspec)
# The 8B benchmark's TRL baselines need Liger's kernels and DeepSpeed (ZeRO-3), which the training
# image does not pin; DeepSpeed's imports (pydantic ...) come along. Installed by scripts/gpu-sft8b.sh.
bench_wheels=(liger-kernel==0.8.5 einops hjson msgpack ninja py-cpuinfo pydantic==2.12.5 pydantic-core==2.41.5
              annotated-types typing-inspection)

step() { printf '== %s\n' "$*" >&2; }

# apt against its own state directory: ROOT SOURCES... (lines for sources.list)
apt_root() {
    local root=$1
    shift
    mkdir -p "$root/lists/partial" "$root/archives/partial" "$root/etc/preferences.d" "$root/etc/trusted.gpg.d"
    [[ -e $root/status ]] || : >"$root/status"
    printf '%s\n' "$@" >"$root/sources.list"
    cat >"$root/apt.conf" <<EOF
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
APT::Install-Recommends "false";
Dir::State "$root";
Dir::State::Lists "$root/lists";
Dir::State::status "$root/status";
Dir::Cache "$root";
Dir::Cache::archives "$root/archives";
Dir::Etc::SourceList "$root/sources.list";
Dir::Etc::SourceParts "-";
Dir::Etc::Preferences "$root/etc/preferences";
Dir::Etc::PreferencesParts "$root/etc/preferences.d";
Dir::Etc::TrustedParts "$root/etc/trusted.gpg.d";
Acquire::Check-Valid-Until "false";
EOF
    APT_CONFIG=$root/apt.conf apt-get update -q -o Acquire::AllowInsecureRepositories=true >&2
}

rm -rf "$out"
mkdir -p "$out/debs" "$out/apptainer" "$out/wheels" "$work"

step "Ubuntu $suite packages: ${packages[*]}, with what they need beyond an Ubuntu base"
noble=$work/$suite
# The archive keys may not be on this machine: [trusted=yes], and the downloads are still checked
# against the hashes in the (unsigned-for-us) Release files.
apt_root "$noble" \
    "deb [trusted=yes] $ubuntu $suite main universe" \
    "deb [trusted=yes] $ubuntu $suite-updates main universe" \
    "deb [trusted=yes] $ubuntu_security $suite-security main universe"
# Count the packages every Ubuntu installation has (Priority: required) as installed, so apt
# downloads only what lies beyond them. The GPU machine's apt decides what it really lacks.
APT_CONFIG=$noble/apt.conf apt-cache dumpavail | "$python" -c '
import sys
for stanza in sys.stdin.read().split("\n\n"):  # one stanza per package: the version apt would install
    fields = dict(l.split(": ", 1) for l in stanza.splitlines() if ": " in l and not l.startswith(" "))
    if fields.get("Priority") == "required":
        keep = ("Package", "Version", "Architecture", "Multi-Arch", "Provides")
        print("Package: " + fields["Package"] + "\nStatus: install ok installed")
        print("\n".join(f"{k}: {fields[k]}" for k in keep[1:] if k in fields) + "\n")
' >"$noble/status.new"
mv "$noble/status.new" "$noble/status"
rm -f "$noble/archives/"*.deb
APT_CONFIG=$noble/apt.conf apt-get install -q -y --download-only "${packages[@]}" >&2
cp "$noble/archives/"*.deb "$out/debs/"
(cd "$out/debs" && dpkg-scanpackages --multiversion . /dev/null 2>/dev/null >Packages)

step "Apptainer from Debian unstable"
sid=$work/sid
apt_root "$sid" "deb [trusted=yes] $debian sid main"
(cd "$out/apptainer" && APT_CONFIG=$sid/apt.conf apt-get download -q apptainer >&2)

step "Python wheels (CPython 3.12, manylinux x86_64): ${wheels[*]}"
constraints=$repo/containers/constraints.txt
pins=()
for name in "${wheels[@]}"; do
    pin=$(grep -i -E "^${name//-/[-_]}==" "$constraints" || true)
    [[ -n $pin ]] || { echo "no pin for $name in $constraints" >&2; exit 1; }
    pins+=("$pin")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$out/wheels" "${pins[@]}" >&2
step "the 8B benchmark's baselines (scripts/gpu-sft8b.sh): Liger and DeepSpeed with what they import"
mkdir -p "$out/bench-wheels"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$out/bench-wheels" "${bench_wheels[@]}" >&2
# DeepSpeed is an sdist whose build imports torch (TESTBED-NOTES): built here, ops compiled on first use.
if "$python" -c 'import torch' 2>/dev/null; then
    "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$out/bench-wheels" \
        "$(grep -i '^deepspeed==' "$constraints")" >&2
else
    echo "no torch in $python: DeepSpeed's wheel not built (the ZeRO-3 baseline, sft8b-seeds, needs it)" >&2
fi
step "ctrain's own wheel"
"$python" -m pip wheel -q --no-deps -w "$out/wheels" "$repo" >&2 # builds in an isolated environment (setuptools from PyPI)

{
    echo "Made by scripts/gpu-bundle.sh on $(date -u +%Y-%m-%dT%H:%MZ) from $(git -C "$repo" describe --always --dirty 2>/dev/null || echo '?')"
    echo "Installed on the GPU machine by scripts/gpu-testbed.sh (offline: apt-get from debs/, dpkg, pip --no-index)."
    echo
    echo "debs/ (Ubuntu $suite):"
    (cd "$out/debs" && ls -1 ./*.deb | sed 's|^\./|  |')
    echo "apptainer/ (Debian sid):"
    (cd "$out/apptainer" && ls -1 ./*.deb | sed 's|^\./|  |')
    echo "wheels/:"
    (cd "$out/wheels" && ls -1 ./*.whl | sed 's|^\./|  |')
    echo "bench-wheels/ (scripts/gpu-sft8b.sh):"
    (cd "$out/bench-wheels" && ls -1 ./*.whl | sed 's|^\./|  |')
} >"$out/README"
du -sh "$out" "$out"/* >&2
echo "$out"
