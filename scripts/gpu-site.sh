# Sourced by the GPU scripts: the training stack's wheels the machine lacks, installed beside its
# Python (never into it) from WHEELS (default .gpu/bundle/wheels and .gpu/bundle/bench-wheels, which
# scripts/gpu-bundle.sh gathers); reads the caller's repo (the checkout), sets py, and PYTHONPATH to
# ctrain's sources and that site.
#   gpu_site SITE
gpu_site() {
    local site=$1 wheels
    py=${PYTHON:-python3}
    [[ -x /opt/torch/.venv/bin/python ]] && py=/opt/torch/.venv/bin/python
    mkdir -p "$site"
    for wheels in ${WHEELS:-$repo/.gpu/bundle/wheels $repo/.gpu/bundle/bench-wheels}; do
        compgen -G "$wheels/*.whl" >/dev/null || continue
        find "$wheels" -name '*.whl' ! -name 'ctrain-*' -print0 |
            xargs -0 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site"
    done
    export PYTHONPATH=$repo/src:$site PYTHONUNBUFFERED=1
}
