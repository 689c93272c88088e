#!/usr/bin/env bash
# The GPU path end to end on one GPU machine that has no package registry (as root):
#
#   probe     what the machine is: OS, glibc, kernel, GPUs and driver, cgroups, namespaces, /dev/fuse
#   install   the bundle from scripts/gpu-bundle.sh, offline: Slurm, munge and the testbed's tools with
#             apt-get from the bundle's own package index, Apptainer unpacked with dpkg-deb, ctrain
#             and the Python wheels the machine lacks with pip --no-index
#   testbed   `ctrain testbed up --nodes 2`: each node gets its share of the GPUs as Slurm gres
#   image     a GPU image built here from what the machine has: its own /usr and /etc and its PyTorch
#             environment (/opt/torch/.venv) plus ctrain and the carried wheels; no NVIDIA driver
#             library inside (Apptainer's --nv brings the host's); squashfs, then SIF
#   checks    what jobs see: CUDA_VISIBLE_DEVICES and SLURM_GPUS_ON_NODE per node, the GPU inside the
#             container with --nv (and none without)
#   demo      recipes/demo-addition.yaml through `ctrain submit --nodes 2 --gpus-per-node 1`, then
#             `ctrain eval` on a GPU
#   sbatch    the same recipe through plain `sbatch sbatch/apptainer_multinode.sbatch`
#   sft       recipes/demo-addition-374m.yaml (the benchmark's model shape) through `ctrain submit`
#   bench     `ctrain bench` tokens/s: bare (1 GPU; 2 GPUs under torchrun, NCCL as it chooses) and
#             through Slurm and Apptainer (1 node x 1 GPU, 2 nodes x 1 GPU)
#   socket    the same bare 2-GPU run with NCCL forced to TCP sockets (P2P and SHM off)
#   preempt   `scancel --signal=USR1 --batch JOB` on a 2-node GPU job: it checkpoints, requeues
#             itself and resumes (from the image its nodes unpacked once)
#   start     `sbatch` to the first training step and the last step to the job's end, 2 nodes x 1 GPU:
#             the image cache cold and warm, and each job unpacking its own copy as before the cache
#             (the library in CTRAIN_GPU_BASELINE_LIB, when that file exists)
#   compile   torch.compile's caches cold and warm: the 8B LoRA bench case run twice, in new processes
#             over one TORCHINDUCTOR_CACHE_DIR (bare, no Slurm needed)
#   sft8b     recipes/llama-3.1-8b-sft.yaml (FSDP2 over all the GPUs of one node, the fast engine)
#             through `ctrain submit`, on the 8B bench case's exported problem; the job is killed once
#             step 3 is logged (the 90 GiB checkpoint at a run's end is measured elsewhere). Not in
#             the default list; use CTRAIN_GPU_NODES=1 so that one node holds every GPU
#   lora8b    recipes/llama-3.1-8b-lora.yaml on the same problem through `ctrain submit` (1 GPU), twice:
#             once preempted (USR1 after step 2: checkpoint, requeue, resume), once uninterrupted, and
#             their losses compared step by step (CTRAIN_GPU_LORA8B_STEPS, default 5). Not in the
#             default list
#
#   scripts/gpu-testbed.sh [STAGE...]     (default: all, in the order above; done stages are skipped)
#
# Settings (environment): CTRAIN_GPU_BUNDLE (default .gpu/bundle in the repository), CTRAIN_GPU_WORK
# (default /var/tmp/ctrain-gpu: logs, results, the image's root), CTRAIN_GPU_DEADLINE (seconds this
# run may take before it skips what is left, default 3000), CTRAIN_GPU_BASELINE_LIB (an earlier
# sbatch/lib/ctrain.sh for the start stage's baseline), CTRAIN_GPU_NODES (the testbed's nodes, default
# 2; the GPUs are split between them), CTRAIN_GPU_SFT8B_OVERRIDES (more recipe overrides for sft8b,
# e.g. model.config_overrides.num_hidden_layers=8 where the GPUs cannot hold 8B), PYTHON (default python3).
# Every stage logs to WORK/logs/STAGE.log and adds a line to WORK/results.txt; the end prints them.
# NVLink multicast stays off everywhere (NCCL_NVLS_ENABLE=0 and friends, passed into every job).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bundle=${CTRAIN_GPU_BUNDLE:-$repo/.gpu/bundle}
work=${CTRAIN_GPU_WORK:-/var/tmp/ctrain-gpu}
deadline=${CTRAIN_GPU_DEADLINE:-3000}
PY=${PYTHON:-python3}
site=/opt/ctrain-host/site # ctrain and the carried wheels for the machine's own Python
state_dir=/var/lib/ctrain/testbed
shared=$state_dir/shared
project=$shared/gpu
image=$project/images/ctrain-gpu.sif
venv=/opt/torch/.venv
start_time=$SECONDS
mkdir -p "$work/logs" "$work/done"
results=$work/results.txt
touch "$results"

# Kept off in every process started here, in jobs and in containers (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
# What every job gets on top (sbatch passes the submitting environment on; Apptainer passes it in).
job_env=(NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
         HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,ENV)

say() { printf '[%4ds] %s\n' "$((SECONDS - start_time))" "$*"; }
left() { echo $((deadline - (SECONDS - start_time))); }
result() { printf '%-8s | %s\n' "$1" "$2" | tee -a "$results"; }
ctrain() { "$PY" -m ctrain "$@"; }
job_user() { stat -c %U "$shared" 2>/dev/null || echo ctrain; }

# as_user CMD...: CMD as the testbed's job user, in the project directory, with the job environment.
as_user() {
    if [[ ${JOB_AS_ROOT:-0} == 1 ]]; then
        (cd "$project" && env "${job_env[@]}" SLURM_CONF="$state_dir/slurm.conf" "$@")
    else
        ctrain testbed exec -- env "${job_env[@]}" bash -c 'cd "$1" && shift && exec "$@"' as-user "$project" "$@"
    fi
}

# submit SBATCH-ARGS...: queue from the project directory; prints the job id.
submit() { as_user sbatch --parsable "$@" | tail -n 1 | cut -d';' -f1; }

# wait_job ID SECONDS: wait for a final state; prints it (cancels the job when time is up).
wait_job() {
    local id=$1 limit=$2 waited=0 state
    (($(left) - 20 < limit)) && limit=$(($(left) - 20))
    ((limit > 10)) || limit=10
    while :; do
        state=$(scontrol show job -o "$id" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
        case $state in
            COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE)
                echo "$state"
                return
                ;;
        esac
        if ((waited >= limit)); then
            scancel "$id" 2>/dev/null
            echo "UNFINISHED(${state:-unknown} after ${limit}s)"
            return
        fi
        sleep 2
        waited=$((waited + 2))
    done
}

# job_log ID: the job's output file (every job here writes logs/NAME-ID.out in the project).
job_log() {
    local file
    file=$(ls "$project"/logs/*-"$1".out 2>/dev/null | head -n 1)
    [[ -n $file ]] || file=$(scontrol show job -o "$1" 2>/dev/null | grep -o 'StdOut=[^ ]*' | cut -d= -f2)
    echo "$file"
}

# nccl_lines FILE: how NCCL connected the ranks (interface, transport of each channel).
nccl_lines() {
    grep -h -E 'NCCL INFO (NET/(Socket|IB|Plugin)|Using network|Channel [0-9]+/[0-9]+ : .* via|NCCL_(NVLS_ENABLE|SOCKET_IFNAME|P2P|SHM))' "$@" 2>/dev/null |
        sed -E 's/^[0-9]+: //' | sort -u | head -n 12
}

# stage NAME MIN_SECONDS: run stage_NAME once, logging to logs/NAME.log; skipped when done before
# or when less than MIN_SECONDS of the deadline is left.
stage() {
    local name=$1 need=$2 rc
    if [[ -e $work/done/$name ]]; then
        say "$name: done before, skipped"
        return 0
    fi
    if (($(left) < need)); then
        result "$name" "SKIPPED: $(left)s left of the deadline, about ${need}s needed"
        return 0
    fi
    say "$name ..."
    ("stage_$name") >"$work/logs/$name.log" 2>&1 # a subshell: set -e and cd stay inside
    rc=$?
    if ((rc == 0)); then
        touch "$work/done/$name"
        say "$name: ok"
    else
        say "$name: FAILED (exit $rc); end of $work/logs/$name.log:"
        tail -n 25 "$work/logs/$name.log" | sed 's/^/    /'
    fi
    return $rc
}

# --- stages -----------------------------------------------------------------------------------------

stage_probe() {
    set -x
    cat /etc/os-release
    ldd --version | head -n 1
    uname -a
    nproc
    grep -E 'MemTotal|MemAvailable' /proc/meminfo
    ls -la /dev/nvidia* /dev/fuse
    cat /proc/driver/nvidia/version
    cat /proc/driver/nvidia/gpus/*/information
    nvidia-smi -L
    nvidia-smi topo -m
    ldconfig -p | grep -E 'libcuda\.so|libnvidia-ml'
    stat -f -c %T /sys/fs/cgroup
    cat /proc/self/cgroup
    cat /proc/sys/user/max_user_namespaces /proc/sys/kernel/unprivileged_userns_clone \
        /proc/sys/kernel/apparmor_restrict_unprivileged_userns 2>&1
    unshare --user --map-root-user true && echo "user namespaces: ok"
    unshare --net true && echo "network namespaces: ok"
    grep -E 'CapEff|CapBnd' /proc/self/status
    command -v python3 "$PY" apt-get dpkg ip slurmd apptainer mksquashfs gcc
    "$PY" -c 'import sys, torch; print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.device_count())'
    "$PY" -m pip list 2>/dev/null | grep -i -E '^(torch|transformers|trl|datasets|accelerate|huggingface|tokenizers|pyarrow|fsspec|triton|nvidia-nccl|numpy) '
    cat "$venv/pyvenv.cfg"
    readlink -f "$venv/bin/python3"
    du -sh /usr /usr/local /opt/torch "$venv/lib/python3.12/site-packages" 2>/dev/null
    du -sh "$venv"/lib/python3.12/site-packages/* 2>/dev/null | sort -h | tail -n 15
    df -h / /var/tmp /tmp
    set +x
    result probe "$(. /etc/os-release && echo "$PRETTY_NAME"), glibc $(ldd --version | head -n 1 | awk '{print $NF}'), kernel $(uname -r), $(nvidia-smi -L 2>/dev/null | wc -l) GPUs, driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1), cgroup fs $(stat -f -c %T /sys/fs/cgroup)"
    return 0
}

# ctrain and the training stack's missing wheels, for this machine's Python (login node side).
install_wheels() {
    rm -rf "$site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$bundle"/wheels/*.whl
    "$PY" -c 'import ctrain; print("ctrain", ctrain.__version__)'
}

stage_install() {
    set -ex
    [[ -d $bundle/debs && -d $bundle/wheels ]] || { echo "no bundle at $bundle (scripts/gpu-bundle.sh makes it)"; return 1; }
    . /etc/os-release
    [[ ${VERSION_CODENAME:-} == noble ]] || echo "warning: the bundle is for Ubuntu 24.04 (noble); this is ${PRETTY_NAME:-unknown}"
    # apt with the bundle as its only source; the machine's own package lists are left alone.
    local list=/tmp/ctrain-bundle.list
    echo "deb [trusted=yes] file:$bundle/debs ./" >"$list"
    local apt=(-o "Dir::Etc::SourceList=$list" -o Dir::Etc::SourceParts=- -o APT::Get::List-Cleanup=0
               -o Acquire::Languages=none)
    # Daemons are started by the testbed, not by the packages' scripts.
    local made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        made_policy=1
    fi
    apt-get "${apt[@]}" update -q
    DEBIAN_FRONTEND=noninteractive apt-get "${apt[@]}" install -y -q --no-install-recommends \
        slurm-wlm munge squashfs-tools iproute2 util-linux procps debootstrap squashfuse fuse2fs \
        uidmap libseccomp2 libsqlite3-0 ca-certificates
    ((made_policy == 0)) || rm -f /usr/sbin/policy-rc.d
    # Apptainer: Debian's package, unpacked. Its maintainer script only registers the `singularity`
    # alternative; its dependency on containernetworking-plugins (for --net) is not carried, and
    # dpkg -i would leave apt refusing every later install for want of it.
    dpkg-deb -x "$bundle"/apptainer/apptainer_*.deb /
    ldconfig
    apptainer --version
    slurmd -V
    install_wheels
    set +x
    local stack
    stack=$("$PY" -c 'import torch, transformers, trl, datasets; print("torch", torch.__version__, "transformers", transformers.__version__, "trl", trl.__version__, "datasets", datasets.__version__)' 2>&1 | tail -n 1 || true)
    result install "slurm $(slurmd -V | awk '{print $2}'), apptainer $(apptainer --version | awk '{print $3}'), $stack"
}

stage_testbed() {
    set -x
    ctrain testbed up --nodes "${CTRAIN_GPU_NODES:-2}" || return 1
    ctrain testbed status
    cat "$state_dir/slurm.conf" "$state_dir/gres.conf" "$state_dir/cgroup.conf" "$state_dir/task-prolog.sh"
    sinfo -N -o '%N %G %c %m %T'
    scontrol show node | grep -E 'NodeName|Gres|CfgTRES'
    # The project directory on the shared filesystem, as on a cluster.
    mkdir -p "$project/logs" "$project/images" "$project/outputs"
    cp -r "$repo/sbatch" "$repo/recipes" "$repo/configs" "$repo/scripts" "$project/"
    cat >"$project/ctrain.yaml" <<EOF
# The GPU check: jobs in the GPU image built on this machine, one process per GPU Slurm gives a node.
slurm:
  runtime: apptainer
  image: $image
  time: "00:30:00"
  env:
    NCCL_DEBUG: INFO
    NCCL_DEBUG_SUBSYS: INIT,NET,ENV
    NCCL_NVLS_ENABLE: "0"
    TORCH_SYMM_MEM_DISABLE_MULTICAST: "1"
    NVSHMEM_DISABLE_NVLS: "1"
    HF_HUB_OFFLINE: "1"
    HF_DATASETS_OFFLINE: "1"
EOF
    chown -R "$(job_user):" "$project"
    set +x
    result testbed "$(sinfo -h -N -o '%N:%G:%T' | tr '\n' ' ')"
}

stage_image() {
    set -ex
    local root=$work/rootfs sqsh=${image%.sif}.sqsh sp
    sp=$("$venv/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    sp=${sp#/} # opt/torch/.venv/lib/python3.12/site-packages
    rm -rf "$root"
    mkdir -p "$root"/{usr,etc,dev,proc,sys,tmp,run,var/tmp,home,root,mnt,srv,opt/torch,opt/ctrain/site}
    mkdir -p "$root"/{workspace,outputs,hf_home,data} "$root/.singularity.d/env" "$root/.singularity.d/libs"
    local binds=(/usr /opt/torch) d
    for d in bin sbin lib lib32 lib64 libx32; do
        if [[ -L /$d ]]; then
            ln -s "$(readlink "/$d")" "$root/$d"
        elif [[ -d /$d ]]; then
            mkdir -p "$root/$d"
            binds+=("/$d")
        fi
    done
    # The venv's interpreter, where it lives outside /usr and /opt/torch.
    local python_home
    python_home=$(dirname "$(dirname "$(readlink -f "$venv/bin/python3")")")
    if [[ $python_home != /usr && $python_home != /opt/torch* && $python_home != /usr/* ]]; then
        mkdir -p "$root$python_home"
        binds+=("$python_home")
    fi
    [[ $(stat -c %A /opt/torch) == *r?x ]] || echo "warning: /opt/torch is closed to other users; jobs run as one"
    cp -a /etc/. "$root/etc/"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$root/opt/ctrain/site" "$bundle"/wheels/*.whl
    cat >"$root/.singularity.d/env/90-environment.sh" <<EOF
# ctrain's GPU image: the machine's PyTorch environment, with ctrain and its extra packages first;
# the rest as containers/Dockerfile sets it (mount targets /workspace, /data, /hf_home, /outputs).
export PATH="$venv/bin:\$PATH"
export VIRTUAL_ENV="$venv"
export PYTHONPATH="/opt/ctrain/site\${PYTHONPATH:+:\$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HF_HOME=/hf_home CTRAIN_DATA_DIR=/data CTRAIN_OUTPUT_DIR=/outputs
# The driver comes from the host (--nv puts it here); Triton would otherwise look it up in this
# image's linker cache, copied from the host, which names driver files the image leaves out.
export TRITON_LIBCUDA_PATH=/.singularity.d/libs
EOF
    # What `apptainer build` writes into every image: the libraries --nv binds are found through
    # LD_LIBRARY_PATH (without it CUDA finds no driver inside the container).
    cat >"$root/.singularity.d/env/99-base.sh" <<'EOF'
if [ -z "${LD_LIBRARY_PATH:-}" ]; then
    LD_LIBRARY_PATH=/.singularity.d/libs
else
    LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/.singularity.d/libs"
fi
PS1="Apptainer> "
export LD_LIBRARY_PATH PS1
EOF
    # Left out: NVIDIA's driver libraries and tools (Apptainer's --nv binds the host's, as on any
    # cluster), documentation, secrets, and Python packages training does not use (JAX, CuPy, ONNX
    # Runtime, TensorStore). The CUDA toolkit stays (compilers may look for ptxas there).
    local excludes=(usr/local/nvidia* usr/local/cuda*/compat usr/share/doc/* usr/share/man/* usr/share/info/*
                    etc/shadow* etc/gshadow* etc/munge etc/slurm etc/ssh/ssh_host_* etc/apptainer)
    local name
    for name in $(grep -v '^#' /etc/apptainer/nvliblist.conf | grep -v '^$'); do
        case $name in
            *.so*) excludes+=("usr/lib/x86_64-linux-gnu/$name*" "usr/lib64/$name*") ;;
            *) excludes+=("usr/bin/$name") ;;
        esac
    done
    for name in jax jaxlib jax_plugins jax_cuda13_plugin jax_cuda13_pjrt cupy cupyx cupy_backends fastrlock \
        onnxruntime tensorstore; do
        excludes+=("$sp/$name" "$sp/${name}-*.dist-info")
    done
    excludes+=("$sp/cupy_cuda*.dist-info" "$sp/jax_cuda*.dist-info")
    printf '%s\n' "${excludes[@]}" >"$work/image-excludes.txt"
    # /usr and the venv are read in place through bind mounts, in a mount namespace of this command only.
    local mounts="" b
    for b in "${binds[@]}"; do mounts+="mount --bind '$b' '$root$b' && "; done
    rm -f "$sqsh" "$image"
    unshare --mount --propagation private bash -c "$mounts mksquashfs '$root' '$sqsh' -noappend -no-progress \
        -comp zstd -Xcompression-level 3 -wildcards -ef '$work/image-excludes.txt'"
    # SIF: the squashfs as the primary system partition, as `apptainer build` writes it.
    apptainer sif new "$image"
    apptainer sif add --datatype 4 --partfs 1 --parttype 2 --partarch 2 --groupid 1 "$image" "$sqsh"
    apptainer sif list "$image"
    rm -f "$sqsh"
    chmod 0644 "$image"
    chown "$(job_user):" "$image"
    ls -la "$project/images"
    set +x
    result image "$image, $(du -h "$image" | cut -f1)"
}

stage_checks() {
    set -x
    local ok=1 out
    # 1. What Slurm gives each node's tasks, in a step and in the batch script.
    as_user srun -N2 --gpus-per-node=1 -l sh -c \
        'echo "$(hostname) CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES SLURM_GPUS_ON_NODE=$SLURM_GPUS_ON_NODE SLURM_STEP_GPUS=${SLURM_STEP_GPUS:-}"' |
        tee "$work/check-srun.txt" || ok=0
    local job
    job=$(submit -N2 --gpus-per-node=1 -o logs/check-%j.out --wrap \
        'echo "batch $(hostname) CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES SLURM_GPUS_ON_NODE=$SLURM_GPUS_ON_NODE SLURM_JOB_GPUS=${SLURM_JOB_GPUS:-}"; srun -l sh -c "echo step \$(hostname) CUDA_VISIBLE_DEVICES=\$CUDA_VISIBLE_DEVICES"')
    echo "check job $job: $(wait_job "$job" 60)"
    cat "$project/logs/check-$job.out"
    # 2. Apptainer as the job user: the GPU inside the image with --nv, the driver from the host.
    local pycheck='import os, socket, torch
ok = torch.cuda.is_available()
p = torch.cuda.get_device_properties(0) if ok else None
maps = [l.split()[-1] for l in open("/proc/self/maps") if "libcuda.so" in l][:1] if ok else []
print(socket.gethostname(), "CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "-"), "torch", torch.__version__,
      "cuda", ok, "devices", torch.cuda.device_count(), p.name if p else "", "uuid GPU-%s" % getattr(p, "uuid", "?"), "libcuda", maps)'
    as_user srun -N2 --gpus-per-node=1 -l apptainer exec --nv --no-home "$image" python3 -c "$pycheck" |
        tee "$work/check-nv.txt" || ok=0
    as_user srun -N1 --gpus-per-node=1 -l apptainer exec --no-home "$image" python3 -c "$pycheck" |
        tee "$work/check-no-nv.txt"
    if ! grep -q 'cuda True' "$work/check-nv.txt"; then
        # Unprivileged Apptainer did not work here: let jobs run as root from now on (Apptainer as
        # root needs `root default capabilities = no` where root lacks CAP_SYS_RESOURCE).
        sed -i 's/^root default capabilities = .*/root default capabilities = no/' /etc/apptainer/apptainer.conf
        JOB_AS_ROOT=1 as_user srun -N2 --gpus-per-node=1 -l apptainer exec --nv --no-home "$image" python3 -c "$pycheck" |
            tee "$work/check-nv-root.txt"
        if grep -q 'cuda True' "$work/check-nv-root.txt"; then
            echo 1 >"$work/job-as-root"
            result checks "apptainer as the job user FAILED; as root it works: later jobs run as root"
        fi
        ok=0
    fi
    set +x
    result checks "srun: $(sed 's/ SLURM_STEP_GPUS=.*//' "$work/check-srun.txt" | tr '\n' ';')"
    result checks "batch: $(grep -h '^batch' "$project/logs/check-$job.out" | tr '\n' ';')"
    result checks "--nv: $(cut -c1-220 "$work/check-nv.txt" | tr '\n' ';')"
    result checks "no --nv: $(cut -c1-120 "$work/check-no-nv.txt" | tr '\n' ';')"
    ((ok == 1))
}

# train_job NAME LIMIT SBATCH-ARGS...: queue, wait, report state, time and NCCL's transport.
train_job() {
    local name=$1 limit=$2 job state log
    shift 2
    job=$(submit "$@")
    [[ $job =~ ^[0-9]+$ ]] || { echo "sbatch failed: $job"; result "$name" "sbatch failed"; return 1; }
    state=$(wait_job "$job" "$limit")
    log=$(job_log "$job")
    echo "job $job: $state; log $log"
    cat "$log"
    scontrol show job -o "$job" | tr ' ' '\n' | grep -E '^(JobState|RunTime|NodeList|TRES|Restarts)='
    result "$name" "job $job $state in $(scontrol show job -o "$job" | grep -o 'RunTime=[^ ]*' | cut -d= -f2); $(grep -h -o 'on [0-9]* node(s) \[[^]]*\] x [0-9]* process(es)' "$log" | head -n 1)"
    local losses
    losses=$(grep -h -o "'loss': [0-9.]*" "$log" | sed -n '1p;$p' | tr '\n' ' ')
    [[ -z $losses ]] || result "$name" "loss first/last: $losses"
    while IFS= read -r line; do result "$name" "$line"; done < <(nccl_lines "$log")
    cp "$log" "$work/logs/" 2>/dev/null
    [[ $state == COMPLETED ]]
}

stage_demo() {
    set -x
    cd "$project" || return 1
    ctrain submit --nodes 2 --gpus-per-node 1 --job-name demo-gpu --write-script logs/demo-gpu.sbatch \
        recipes/demo-addition.yaml data.packing=true 'logging.report_to=[]' || return 1
    chown -R "$(job_user):" "$project/logs"
    train_job demo 420 logs/demo-gpu.sbatch || return 1
    # The trained model, on one GPU, in the same image and with the mounts the job had.
    as_user mkdir -p .cache/hf
    as_user srun -N1 --gpus-per-node=1 apptainer exec --nv --no-home --pwd /workspace --bind "$project:/workspace" \
        --bind "$project/outputs:/outputs" --bind "$project/.cache/hf:/hf_home" "$image" \
        python3 -m ctrain eval recipes/demo-addition.yaml --min-accuracy 0.9 | tee "$work/demo-eval.txt"
    local rc=${PIPESTATUS[0]}
    set +x
    result demo "eval: $(grep -i -o 'accuracy[^,]*' "$work/demo-eval.txt" | head -n 1)"
    return "$rc"
}

stage_sbatch() {
    set -x
    train_job sbatch 300 --nodes=2 --gpus-per-node=1 --job-name=demo-sbatch \
        --export="ALL,IMAGE=$image" sbatch/apptainer_multinode.sbatch recipes/demo-addition.yaml \
        training.max_steps=200 training.output_dir=outputs/demo-sbatch data.packing=true 'logging.report_to=[]'
}

stage_sft() {
    set -x
    cd "$project" || return 1
    ctrain submit --nodes 2 --gpus-per-node 1 --job-name sft-374m --write-script logs/sft-374m.sbatch \
        recipes/demo-addition-374m.yaml 'logging.report_to=[]' || return 1
    chown -R "$(job_user):" "$project/logs"
    train_job sft 420 logs/sft-374m.sbatch
}

# bench_row LABEL JSON: one line of the results table from a bench JSON file.
bench_row() {
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
label, path = sys.argv[1:]
try:
    r = [x for x in json.load(open(path))["results"] if "error" not in x][0]
except Exception as exc:  # noqa: BLE001
    print(f"{label}: no result ({type(exc).__name__}: {exc})")
else:
    print(f"{label}: {r['world_size']} GPU(s), {r['tokens_per_s']:,.0f} tokens/s, {r['tokens_per_s_per_device']:,.0f} per GPU, "
          f"step {r['step_ms']:.0f} ms, MFU {100 * r['mfu_6n']:.1f}%, peak {r['peak_memory_gib']:.1f} GiB")
EOF
}

first_step_row() {
    "$PY" - "$1" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
    c = r.get("compile", {})
    print(f"first step {r['first_step_seconds']:.1f} s after training started, train() {r['wall_seconds']:.0f} s; "
          f"graphs: {c.get('graphs_compiled')} compiled, {c.get('graphs_from_cache')} from the cache; {c.get('phases_s')}")
except Exception as exc:  # noqa: BLE001
    print(f"no result ({type(exc).__name__}: {exc})")
EOF
}

stage_bench() {
    set -x
    local out=$work/bench args=(--device cuda --cases ctrain --warmup 8 --steps 30) job
    mkdir -p "$out"
    cd "$out" || return 1
    # Bare: this machine's Python, no Slurm, no container.
    CUDA_VISIBLE_DEVICES=0 "$PY" -m ctrain bench "${args[@]}" --json "$out/bare-1.json" --out "$out/bare-1"
    NCCL_DEBUG=INFO "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m ctrain bench "${args[@]}" \
        --json "$out/bare-2.json" --out "$out/bare-2" 2>&1 | tee "$out/bare-2.log"
    # Through Slurm and Apptainer: 1 node x 1 GPU, 2 nodes x 1 GPU (NCCL between the node namespaces).
    for nodes in 1 2; do
        job=$(submit --nodes="$nodes" --gpus-per-node=1 --cpus-per-task=8 --job-name="bench-${nodes}n" --export="ALL,IMAGE=$image" \
            scripts/gpu-bench.sbatch --cases ctrain --warmup 8 --steps 30)
        echo "bench job $job ($nodes nodes): $(wait_job "$job" 400)"
        cat "$(job_log "$job")"
        cp "$project/outputs/bench-$job.json" "$out/slurm-${nodes}n.json"
        cp "$(job_log "$job")" "$out/slurm-${nodes}n.log"
    done
    set +x
    result bench "$(bench_row 'bare, 1 GPU' "$out/bare-1.json")"
    result bench "$(bench_row 'bare torchrun, 2 GPUs (NCCL as it chooses)' "$out/bare-2.json")"
    result bench "$(bench_row 'Slurm+Apptainer, 1 node x 1 GPU' "$out/slurm-1n.json")"
    result bench "$(bench_row 'Slurm+Apptainer, 2 nodes x 1 GPU' "$out/slurm-2n.json")"
    local f
    for f in bare-2 slurm-2n; do
        while IFS= read -r line; do result bench "$f: $line"; done < <(nccl_lines "$out/$f.log")
    done
    [[ -s $out/slurm-2n.json ]]
}

# Bare, 2 GPUs, NCCL kept off NVLink and shared memory: TCP sockets on one host, the baseline for
# the 2-node figure (the same transport without Slurm, Apptainer or the veth between namespaces).
stage_socket() {
    set -x
    local out=$work/bench
    mkdir -p "$out"
    cd "$out" || return 1
    NCCL_DEBUG=INFO NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node=2 -m ctrain bench --device cuda --cases ctrain --warmup 8 --steps 30 \
        --json "$out/bare-2-socket.json" --out "$out/bare-2-socket" 2>&1 | tee "$out/bare-2-socket.log"
    set +x
    result socket "$(bench_row 'bare torchrun, 2 GPUs, NCCL_P2P/SHM off (sockets)' "$out/bare-2-socket.json")"
    while IFS= read -r line; do result socket "$line"; done < <(nccl_lines "$out/bare-2-socket.log")
    [[ -s $out/bare-2-socket.json ]]
}

stage_preempt() {
    set -x
    local job log run=outputs/preempt waited=0 state
    rm -rf "${project:?}/$run"
    job=$(submit --nodes=2 --gpus-per-node=1 --job-name=preempt --export="ALL,IMAGE=$image" \
        sbatch/apptainer_multinode.sbatch recipes/demo-addition.yaml "training.output_dir=$run" data.packing=true \
        'logging.report_to=[]')
    [[ $job =~ ^[0-9]+$ ]] || return 1
    until [[ -e $project/$run/checkpoint-200/ctrain-complete.json ]]; do
        sleep 0.5
        waited=$((waited + 1))
        state=$(scontrol show job -o "$job" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
        if [[ $state != RUNNING && $state != PENDING && $state != CONFIGURING ]] || ((waited > 480)); then
            echo "no checkpoint-200 (job $state)"
            cat "$(job_log "$job")"
            result preempt "no checkpoint-200 before the job ended ($state)"
            return 1
        fi
    done
    scancel --signal=USR1 --batch "$job"
    state=$(wait_job "$job" 360)
    log=$(job_log "$job")
    cat "$log"
    ls -la "$project/$run"
    cat "$project/$run/ctrain-preempted.json"
    set +x
    result preempt "job $job $state, restarts $(scontrol show job -o "$job" | grep -o 'Restarts=[0-9]*' | cut -d= -f2): $(grep -h -E 'SIGUSR1|requeueing|resuming from|step exited' "$log" | sed -E 's/^[0-9]+: //' | sort -u | head -n 6 | tr '\n' ';')"
    result preempt "the image, run by run: $(grep -h -o -E '^ctrain: job [0-9]+ .* restart [0-9]+|unpacked [^ ]+ into [^ ]+ in [0-9]+ s|the image is cached in [^ ]+' "$log" | sed -E 's/ .* restart / restart /' | tr '\n' ';')"
    cp "$log" "$work/logs/" 2>/dev/null
    [[ $state == COMPLETED ]] && grep -q 'resuming from' "$log"
}

# time_job LABEL [SBATCH-ARGS...]: a 20-step demo job on 2 nodes x 1 GPU, timed from outside (the log
# polled every 0.1 s): sbatch to step 1, and step 20 to the job's end.
time_job() {
    local label=$1 t0 t1= t2= t3= job log= state waited=0
    shift
    t0=$(date +%s.%N)
    job=$(submit --nodes=2 --gpus-per-node=1 --job-name="start-$label" "$@" sbatch/apptainer_multinode.sbatch \
        recipes/demo-addition.yaml training.max_steps=20 training.logging_steps=1 training.save_steps=1000 \
        "training.output_dir=outputs/start-$label" data.packing=true 'logging.report_to=[]')
    [[ $job =~ ^[0-9]+$ ]] || { result start "$label: sbatch failed: $job"; return 1; }
    while :; do
        [[ -n $log ]] || log=$(ls "$project"/logs/*-"$job".out 2>/dev/null | head -n 1)
        if [[ -n $log ]]; then
            [[ -n $t1 ]] || ! grep -q 'step 1/20, loss' "$log" || t1=$(date +%s.%N)
            [[ -n $t2 ]] || ! grep -q 'step 20/20, loss' "$log" || t2=$(date +%s.%N)
        fi
        state=$(scontrol show job -o "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
        case $state in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL) t3=$(date +%s.%N); break ;; esac
        ((waited < 6000)) || { scancel "$job"; result start "$label: job $job still $state after 600 s"; return 1; }
        sleep 0.1
        waited=$((waited + 1))
    done
    cp "$log" "$work/logs/" 2>/dev/null
    [[ $state == COMPLETED && -n $t1 && -n $t2 ]] || { result start "$label: job $job $state"; cat "$log"; return 1; }
    result start "$label: sbatch to step 1 $(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }") s, step 20 to the job's end $(awk "BEGIN { printf \"%.1f\", $t3 - $t2 }") s; $(grep -h -o -E 'unpacked [^ ]+ into [^ ]+ in [0-9]+ s|the image is cached|exec --unsquash' "$log" | sed -E 's/ into [^ ]+//' | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
}

stage_start() {
    set -x
    local cache
    cache=/tmp/ctrain-images-$(id -u "$(job_user)")
    chmod -R u+rwX "$cache" 2>/dev/null
    rm -rf "$cache"
    time_job cache-cold --export="ALL,IMAGE=$image" || return 1
    time_job cache-warm-1 --export="ALL,IMAGE=$image" || return 1
    time_job cache-warm-2 --export="ALL,IMAGE=$image" || return 1
    if [[ -f ${CTRAIN_GPU_BASELINE_LIB:-} ]]; then
        cp "$CTRAIN_GPU_BASELINE_LIB" "$project/baseline-ctrain.sh"
        chmod a+r "$project/baseline-ctrain.sh"
        time_job unsquash --export="ALL,IMAGE=$image,CTRAIN_SBATCH_LIB=$project/baseline-ctrain.sh" || return 1
    fi
}

# torch.compile's caches, cold then warm, bare (no Slurm: the sbatch library only points
# TORCHINDUCTOR_CACHE_DIR at the project's .cache; every node of a job and of the next one reads
# the same directory): each run is a new process that finds what the one before it compiled, as a
# requeue on another node does: the 8B LoRA bench case (the demo recipe trains under transformers'
# Trainer, which compiles nothing).
stage_compile() {
    set -x
    local out=$work/compile run
    [[ -e $work/done/install ]] || install_wheels
    rm -rf "$out"
    mkdir -p "$out"
    cd "$out" || return 1
    # CTRAIN_GPU_COMPILE_RUNS: the runs, in order; "warm-1thread": inductor loads its kernels in
    # this process (TORCHINDUCTOR_COMPILE_THREADS=1) instead of a pool of compile workers.
    local runs=(${CTRAIN_GPU_COMPILE_RUNS:-cold warm})
    for run in "${runs[@]}"; do
        [[ $run != *1thread ]] || export TORCHINDUCTOR_COMPILE_THREADS=1
        TORCHINDUCTOR_CACHE_DIR=$out/cache/torchinductor TRITON_CACHE_DIR=$out/cache/triton CUDA_VISIBLE_DEVICES=0 \
            "$PY" -m ctrain bench --device cuda \
            --cases lora-ctrain --warmup 1 --steps 2 --json "$out/lora-$run.json" --out "$out/lora-$run" 2>&1 |
            tee "$out/lora-$run.log" | grep -E 'bench:|error' || true
    done
    set +x
    for run in "${runs[@]}"; do
        result compile "lora-ctrain (8B LoRA), $run: $(first_step_row "$out/lora-$run.json")"
    done
    du -sh "$out"/cache/* | while read -r line; do result compile "size: $line"; done
}

# export_sft8b: the 8B bench case's problem (chats, tokenizer, random bf16 checkpoint) in the project
# directory, once, and the recipe overrides that point at it in sft8b-inputs.overrides.
export_sft8b() {
    [[ -e sft8b-inputs.overrides ]] && return 0 # relative paths: the jobs run in the project directory
    rm -rf sft8b-inputs
    "$PY" -m ctrain bench --cases sft8b-ctrain --export sft8b-inputs | tail -n 1 | tr ' ' '\n' \
        >sft8b-inputs.overrides.new || return 1
    mv sft8b-inputs.overrides.new sft8b-inputs.overrides
}

# wait_for_line JOB PATTERN: wait until the job's log has PATTERN, the job has left the queue's
# running states, or the deadline is near; prints the seconds waited.
wait_for_line() {
    local job=$1 pattern=$2 waited=0 log state
    while ((waited < $(left) - 60)); do
        log=$(job_log "$job")
        [[ -n $log ]] && grep -q "$pattern" "$log" 2>/dev/null && break
        state=$(scontrol show job -o "$job" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
        [[ $state == PENDING || $state == RUNNING || $state == CONFIGURING ]] || break
        sleep 1
        waited=$((waited + 1))
    done
    echo "$waited"
}

# losses LOG: "STEP LOSS" for each logged step.
losses() { grep -h -o -E 'step [0-9]+/[0-9]+, loss [0-9.]+' "$1" | sed -E 's/step ([0-9]+)\/[0-9]+, loss /\1 /' | sort -n -u; }

stage_lora8b() {
    set -x
    cd "$project" || return 1
    export_sft8b || return 1
    local overrides run job log state steps=${CTRAIN_GPU_LORA8B_STEPS:-5}
    mapfile -t overrides <sft8b-inputs.overrides
    local -A jobs=()
    # p: USR1 to the batch script once step 2 is logged; it checkpoints, requeues and resumes.
    # u: the same run uninterrupted, for its losses.
    for run in p u; do
        rm -rf "outputs/lora8b-$run"
        ctrain submit --nodes 1 --gpus-per-node 1 --job-name "lora8b-$run" --write-script "logs/lora8b-$run.sbatch" \
            recipes/llama-3.1-8b-lora.yaml "${overrides[@]}" "training.max_steps=$steps" training.logging_steps=1 \
            training.save_steps=1000 "training.output_dir=outputs/lora8b-$run" 'logging.report_to=[]' || return 1
        chown -R "$(job_user):" "$project"
        job=$(submit "logs/lora8b-$run.sbatch")
        [[ $job =~ ^[0-9]+$ ]] || { result lora8b "sbatch failed: $job"; return 1; }
        jobs[$run]=$job
        if [[ $run == p ]]; then
            wait_for_line "$job" 'step 2/' >/dev/null
            scancel --signal=USR1 --batch "$job"
        fi
        state=$(wait_job "$job" 400)
        log=$(job_log "$job")
        cat "$log"
        cp "$log" "$work/logs/"
        result lora8b "$run: job $job $state, restarts $(scontrol show job -o "$job" | grep -o 'Restarts=[0-9]*' | cut -d= -f2): $(grep -h -E 'SIGUSR1|requeueing|resuming from|step exited|tokens/s' "$log" | sed -E 's/^[0-9]+: //' | sort -u | head -n 8 | tr '\n' ';')"
        result lora8b "$run: losses $(losses "$log" | tr '\n' ';')"
        ls -la "outputs/lora8b-$run" "outputs/lora8b-$run/final" 2>&1 | head -n 30
    done
    set +x
    result lora8b "p against u: $(join <(losses "$(job_log "${jobs[p]}")") <(losses "$(job_log "${jobs[u]}")") |
        awk '{ d = $2 - $3; d = d < 0 ? -d : d; if (d > m) m = d; n++ } END { printf "%d steps in both, largest |difference| %.6f", n, m }')"
    grep -q 'resuming from' "$(job_log "${jobs[p]}")"
}

stage_sft8b() {
    set -x
    cd "$project" || return 1
    local per_node job log state waited=0 overrides
    per_node=$(sinfo -h -N -o '%G' | head -n 1 | grep -o 'gpu:[0-9]*' | cut -d: -f2)
    [[ $per_node =~ ^[0-9]+$ ]] || { echo "no GPUs in sinfo"; return 1; }
    export_sft8b || return 1
    mapfile -t overrides <sft8b-inputs.overrides
    # shellcheck disable=SC2086 # the extra overrides are words
    ctrain submit --nodes 1 --gpus-per-node "$per_node" --job-name sft8b --write-script logs/sft8b.sbatch \
        recipes/llama-3.1-8b-sft.yaml "${overrides[@]}" training.max_steps=20 training.logging_steps=1 \
        'logging.report_to=[]' ${CTRAIN_GPU_SFT8B_OVERRIDES:-} || return 1
    chown -R "$(job_user):" "$project"
    job=$(submit logs/sft8b.sbatch)
    [[ $job =~ ^[0-9]+$ ]] || { result sft8b "sbatch failed: $job"; return 1; }
    waited=$(wait_for_line "$job" 'step 3/')
    scancel --signal=KILL --full "$job"
    state=$(wait_job "$job" 60)
    log=$(job_log "$job")
    cat "$log"
    cp "$log" "$work/logs/"
    set +x
    result sft8b "job $job $state after ${waited}s: $(grep -h -o 'on [0-9]* node(s) \[[^]]*\] x [0-9]* process(es)' "$log" | head -n 1)"
    grep -h -E 'preflight|training |step [0-9]+/|step [0-9]+ memory' "$log" | tail -n 12 | while IFS= read -r line; do
        result sft8b "$line"
    done
    grep -q 'step 3/' "$log"
}

# --- main -------------------------------------------------------------------------------------------

all=(probe install testbed image checks demo sbatch sft bench socket preempt start compile)
(($# > 0)) && stages=("$@") || stages=("${all[@]}")
# Rough seconds each stage needs at least (it is skipped with less left before the deadline).
declare -A need=([probe]=5 [install]=60 [testbed]=30 [image]=120 [checks]=40 [demo]=150 [sbatch]=120 [sft]=150
                 [bench]=240 [socket]=60 [preempt]=200 [start]=300 [compile]=300 [sft8b]=240 [lora8b]=300)
[[ -e $work/job-as-root ]] && JOB_AS_ROOT=1
say "stages: ${stages[*]} (deadline ${deadline}s; logs in $work/logs)"
# Jobs a run that was stopped half-way left behind would hold the GPUs.
if [[ -e $state_dir/testbed.json ]]; then
    old=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    [[ -z ${old// /} ]] || { say "cancelling jobs left from before: $old"; scancel $old; sleep 3; }
fi
for s in "${stages[@]}"; do
    stage "$s" "${need[$s]:-30}"
    rc=$?
    [[ -e $work/job-as-root ]] && JOB_AS_ROOT=1
    # Nothing after these can work without them.
    if ((rc != 0)) && [[ $s == install || $s == testbed || $s == image ]]; then
        result "$s" "FAILED: the stages after it need it; stopping"
        break
    fi
done
say "results:"
cat "$results"
