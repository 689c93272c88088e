# Print a command as one shell line (words quoted only where the shell needs it).
ctrain_show() {
    local word line=+
    for word in "$@"; do
        if [[ $word =~ ^[][A-Za-z0-9_@%+=:,./^-]+$ ]]; then
            line+=" $word"
        else
            line+=" '${word//\'/\'\\\'\'}'"
        fi
    done
    echo "$line"
}

# An absolute path for a file setting given relative to the project directory (or to ~).
ctrain_abspath() {
    case $1 in
        /*) echo "$1" ;;
        "~"/*) echo "$HOME/${1#"~/"}" ;;
        *) echo "$CTRAIN_PROJECT_DIR/${1#./}" ;;
    esac
}

# Whether an image setting names a file (else a registry reference): a path (/, ./, ../, ~/), a
# name ending .sif, .sqsh or .squashfs, or something that exists in the project directory; never
# a URI (docker://...). The same rule in Python is ctrain.jobs.submit.image_is_file; a test keeps the
# two in agreement.
ctrain_image_is_file() {
    case $1 in
        "") return 1 ;;
        /* | ./* | ../* | "~"/* | . | ..) return 0 ;;
        *://*) return 1 ;;
        *.sif | *.sqsh | *.squashfs) return 0 ;;
    esac
    local path
    path=$(ctrain_abspath "$1")
    [[ -e $path || -L $path ]]
}

# A registry reference as enroot spells it for pyxis, [REGISTRY#]IMAGE[:TAG]:
# nvcr.io/nvidia/pytorch:TAG -> nvcr.io#nvidia/pytorch:TAG, docker.io/library/ubuntu:TAG ->
# ubuntu:TAG, docker://REF -> REF converted; enroot's own form and other URIs stay as they are.
# The same conversion in Python (with the checks) is ctrain.image.reference.enroot.
ctrain_enroot_image() {
    local ref=${1#docker://} first
    first=${ref%%/*}
    if [[ $ref == *://* || $ref == *#* || $ref != */* ]] ||
        [[ $first != *.* && $first != *:* && $first != localhost ]]; then
        echo "$ref"
        return
    fi
    case $first in
        docker.io | index.docker.io | registry-1.docker.io)
            ref=${ref#*/}
            echo "${ref#library/}"
            ;;
        *) echo "$first#${ref#*/}" ;;
    esac
}

ctrain_die() {
    echo "ctrain: error: $*" >&2
    exit 2
}
