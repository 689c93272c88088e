ctrain_allocation() {
    [[ -n ${SLURM_JOB_ID:-} && -n ${SLURM_NNODES:-} && -n ${SLURM_JOB_NODELIST:-} ]] ||
        ctrain_die "no Slurm allocation here: submit this script with sbatch (or run it inside salloc)"
    CTRAIN_NNODES=$SLURM_NNODES
    # The node this batch script runs on: lost, it takes the script with it (ctrain_sentinel).
    CTRAIN_BATCH_HOST=${SLURMD_NODENAME:-$(uname -n)}
    # One worker per GPU on the node; without GPUs one per task Slurm placed on the node
    # (SLURM_TASKS_PER_NODE looks like "2(x3),1": the first node's count).
    if [[ ${SLURM_GPUS_ON_NODE:-0} -gt 0 ]]; then
        CTRAIN_NPROC_PER_NODE=$SLURM_GPUS_ON_NODE
    else
        CTRAIN_NPROC_PER_NODE=${SLURM_TASKS_PER_NODE%%[(,]*}
    fi
    # The first node hosts the c10d rendezvous store.
    CTRAIN_MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    # A port per job, above Linux's ephemeral range (32768-60999); the same formula as enroot's
    # PyTorch hook, so the two agree even where that hook runs.
    CTRAIN_MASTER_PORT=$((SLURM_JOB_ID % 4536 + 61000))
    [[ -n $CTRAIN_MASTER_ADDR ]] || ctrain_die "no hostnames in SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}'"
}

# --- environment ----------------------------------------------------------------------------------

ctrain_environment() {
    local cpus=${SLURM_CPUS_ON_NODE:-1}
    export PYTHONUNBUFFERED=1 # every line reaches logs/%x-%j.out as it is printed
    export PYTHONNOUSERSITE=1 # packages in ~/.local on the host must not shadow the image's
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cpus / CTRAIN_NPROC_PER_NODE > 0 ? cpus / CTRAIN_NPROC_PER_NODE : 1))}
    # After TERM (preemption, scancel) torchrun forwards it to its workers and waits this long for
    # them to save a checkpoint and exit; Slurm's own time limit is the hard bound anyway.
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}
    # torch.compile's caches (inductor's graphs and kernels, AOTAutograd's, the autotuner's) on the
    # project's storage, which every node mounts: a requeue on other nodes, and the next job of
    # the same recipe, load the compiled layers instead of compiling them again. torch keys each
    # entry by its own version, the GPU and the graph, so one directory serves every image.
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$CTRAIN_WORKDIR/.cache/torchinductor}
    local forced=(PYTHONUNBUFFERED PYTHONNOUSERSITE OMP_NUM_THREADS TORCHINDUCTOR_CACHE_DIR)
    if [[ $CTRAIN_MOUNT_HOME != 1 ]]; then
        # No home directory in the container: what tools cache under ~ goes to the project's
        # .cache/ instead (kept between jobs, shared by the nodes): extensions DeepSpeed and torch
        # compile on first use, Triton's kernels.
        export XDG_CACHE_HOME=$CTRAIN_WORKDIR/.cache
        export TORCH_EXTENSIONS_DIR=$XDG_CACHE_HOME/torch_extensions TRITON_CACHE_DIR=$XDG_CACHE_HOME/triton
        forced+=(XDG_CACHE_HOME TORCH_EXTENSIONS_DIR TRITON_CACHE_DIR)
    fi
    if [[ $CTRAIN_HF_OFFLINE == 1 ]]; then
        # Compute nodes have no internet: a hub name not in the mounted cache fails at once, by
        # name, instead of retrying a download until a timeout (ctrain submit checks the cache first).
        export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
        forced+=(HF_HUB_OFFLINE HF_DATASETS_OFFLINE)
    fi
    if [[ $CTRAIN_LAUNCHER == accelerate && ${SLURM_GPUS_ON_NODE:-0} -eq 0 ]]; then
        # Without this accelerate's workers stay single-process on CPU-only nodes.
        export ACCELERATE_USE_CPU=true
    fi
    if [[ $CTRAIN_EFA == 1 ]]; then
        # AWS Elastic Fabric Adapter: NCCL over libfabric's EFA provider (the image needs
        # libfabric and the aws-ofi-nccl plugin, as AWS's deep learning images have).
        export FI_PROVIDER=efa
        export FI_EFA_USE_DEVICE_RDMA=1 # GPUDirect RDMA (p4d, p5)
        export FI_EFA_FORK_SAFE=1       # data loader workers fork
        export FI_EFA_USE_HUGE_PAGE=0   # ... and huge pages break fork
        export NCCL_SOCKET_IFNAME=^docker,lo,veth
        forced+=(FI_PROVIDER FI_EFA_USE_DEVICE_RDMA FI_EFA_FORK_SAFE FI_EFA_USE_HUGE_PAGE NCCL_SOCKET_IFNAME)
    fi
    local yours=()
    [[ -z $CTRAIN_CONTAINER_ENV ]] || IFS=, read -ra yours <<<"$CTRAIN_CONTAINER_ENV"
    CTRAIN_FORCED_ENV=("${forced[@]}" "${yours[@]}")
}

# --- container ------------------------------------------------------------------------------------

# Host directory -> image mount target (containers/Dockerfile names the targets).
ctrain_mounts() {
    CTRAIN_MOUNT_LIST=("$CTRAIN_PROJECT_DIR:$CTRAIN_WORKDIR" "$CTRAIN_HF_CACHE:/hf_home" "$CTRAIN_OUTPUTS:/outputs")
    [[ -z $CTRAIN_DATA ]] || CTRAIN_MOUNT_LIST+=("$CTRAIN_DATA:/data:ro")
    local more=()
    [[ -z $CTRAIN_MOUNTS ]] || IFS=, read -ra more <<<"$CTRAIN_MOUNTS"
    CTRAIN_MOUNT_LIST+=("${more[@]}")
    # Writable mounts must exist before the container starts; creating them is harmless.
    [[ $CTRAIN_DRY_RUN == 1 ]] || mkdir -p "$CTRAIN_HF_CACHE" "$CTRAIN_OUTPUTS"
}

# Apptainer: words that go between srun's options and the launcher.
ctrain_container_apptainer() {
    local apptainer=apptainer # or its older name, where only that is installed
    command -v apptainer >/dev/null || ! command -v singularity >/dev/null || apptainer=singularity
    if [[ $CTRAIN_DRY_RUN != 1 ]]; then
        command -v "$apptainer" >/dev/null ||
            ctrain_die "neither apptainer nor singularity is on PATH (try: module load apptainer)"
        if [[ $CTRAIN_IMAGE != *://* && ! -r $CTRAIN_IMAGE ]]; then
            ctrain_image_is_file "$CTRAIN_IMAGE" || ctrain_die "image '$CTRAIN_IMAGE' is a registry" \
                "reference: Apptainer pulls it as IMAGE=docker://$CTRAIN_IMAGE (or run: ctrain convert --to sif)"
            ctrain_die "image '$CTRAIN_IMAGE' cannot be read (set IMAGE=..., or run: ctrain convert --to sif)"
        fi
    fi
    CTRAIN_CONTAINER=("$apptainer" exec)
    # Unprivileged Apptainer serves a SIF's files through squashfuse, a process of the step: Slurm's
    # TERM (scancel, scontrol requeue, preemption) ends it with the workers, whose next read of the
    # image then dies of SIGBUS mid-checkpoint. Unpacked to a node-local directory first (what
    # enroot does for pyxis), the image has no process that a TERM can end. An image file is
    # unpacked once per node into the image cache (ctrain_image_cache) and every later job there
    # runs that copy. A registry reference runs as Apptainer pulls it, through squashfuse.
    CTRAIN_IMAGE_ENTRY=
    if [[ $CTRAIN_APPTAINER_UNSQUASH == 1 ]] && ctrain_image_is_file "$CTRAIN_IMAGE" && [[ ! -d $CTRAIN_IMAGE ]]; then
        CTRAIN_IMAGE_ENTRY=$CTRAIN_IMAGE_CACHE/$(ctrain_image_key "$CTRAIN_IMAGE")
        # The task holds the entry while it runs, so that no other job evicts it (CTRAIN_IMAGE_HOLD).
        CTRAIN_CONTAINER=(sh -c "$CTRAIN_IMAGE_HOLD" ctrain-image "$CTRAIN_IMAGE_ENTRY" "${CTRAIN_CONTAINER[@]}")
    elif [[ $CTRAIN_APPTAINER_UNSQUASH == 1 && $CTRAIN_IMAGE == *://* ]]; then
        echo "ctrain: note: $CTRAIN_IMAGE runs through squashfuse, which a TERM ends before the workers" \
            "checkpoint; pull it once to a file (apptainer pull images/NAME.sif $CTRAIN_IMAGE) to run it cached" >&2
    fi
    # GPUs only when Slurm gave the job some: --nv on a CPU node only prints warnings.
    [[ ${SLURM_GPUS_ON_NODE:-0} -eq 0 ]] || CTRAIN_CONTAINER+=(--nv)
    [[ $CTRAIN_MOUNT_HOME == 1 ]] || CTRAIN_CONTAINER+=(--no-home)
    local mount
    for mount in "${CTRAIN_MOUNT_LIST[@]}"; do
        CTRAIN_CONTAINER+=(--bind "$mount")
    done
    local run=${CTRAIN_IMAGE_ENTRY:+$CTRAIN_IMAGE_ENTRY/rootfs}
    CTRAIN_CONTAINER+=(--pwd "$CTRAIN_WORKDIR" "${run:-$CTRAIN_IMAGE}")
    # Host variables reach the container, but the image's own values win unless set this way.
    local name
    for name in "${CTRAIN_FORCED_ENV[@]}"; do
        export "APPTAINERENV_$name=${!name}" "SINGULARITYENV_$name=${!name}"
    done
}

# pyxis: options for srun itself (pyxis is a plugin of srun); the command then runs in the image.
ctrain_container_pyxis() {
    local mounts
    if [[ $CTRAIN_DRY_RUN != 1 && $CTRAIN_IMAGE == /* && ! -r $CTRAIN_IMAGE ]]; then
        ctrain_die "image '$CTRAIN_IMAGE' cannot be read (set IMAGE=..., or run: ctrain convert --to sqsh)"
    fi
    mounts=$(IFS=,; echo "${CTRAIN_MOUNT_LIST[*]}")
    CTRAIN_SRUN_CONTAINER=(
        --container-image="$CTRAIN_IMAGE" # a .sqsh file, or a registry reference (nvcr.io#nvidia/pytorch:TAG)
        --container-mounts="$mounts"
        --container-workdir="$CTRAIN_WORKDIR"
        --no-container-remap-root # run as the user, not as a fake root
        --no-container-entrypoint # the image's entrypoint is `ctrain`; run the launcher directly
    )
    if [[ $CTRAIN_MOUNT_HOME == 1 ]]; then
        CTRAIN_SRUN_CONTAINER+=(--container-mount-home)
    else
        CTRAIN_SRUN_CONTAINER+=(--no-container-mount-home)
    fi
    CTRAIN_SRUN_CONTAINER+=(--container-env="$(IFS=,; echo "${CTRAIN_FORCED_ENV[*]}")")
    CTRAIN_CONTAINER=()
}

ctrain_container() {
    ctrain_mounts
    CTRAIN_SRUN_CONTAINER=()
    "ctrain_container_$CTRAIN_RUNTIME"
}

# --- launcher -------------------------------------------------------------------------------------

# What the launcher starts in each worker: `-m ctrain train RECIPE OVERRIDES`, or your command:
# `SCRIPT.py ARGS` and `-m MODULE ARGS` as torchrun and accelerate take them; anything else (a
# `python -u ...`, a shell script, a binary) as a program of its own (torchrun --no-python,
# accelerate --no_python). Either way the workers get RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
# and MASTER_PORT from the launcher, and run in the project directory (CTRAIN_WORKDIR).
ctrain_launcher() {
    local train=(-m ctrain train "$CTRAIN_RECIPE" "${CTRAIN_OVERRIDES[@]}") program=()
    if ((${#CTRAIN_COMMAND[@]} > 0)); then
        train=("${CTRAIN_COMMAND[@]}")
        case ${train[0]} in
            -m | *.py) ;;
            *) program=(--no-python) ;;
        esac
    fi
    local endpoint=$CTRAIN_MASTER_ADDR:$CTRAIN_MASTER_PORT
    CTRAIN_STORE=
    case $CTRAIN_LAUNCHER in
        torchrun | deepspeed)
            # DeepSpeed runs under torchrun: its own launcher needs pdsh/ssh between nodes,
            # which containers on Slurm do not have. CTRAIN_DEEPSPEED_CONFIG is a default (?=): a
            # recipe that names its own config keeps it. A command of your own takes its DeepSpeed
            # config in its own arguments (--deepspeed FILE, as HF's scripts do).
            [[ $CTRAIN_LAUNCHER == torchrun || ${#CTRAIN_COMMAND[@]} -gt 0 ]] ||
                train+=("training.deepspeed?=$CTRAIN_DEEPSPEED_CONFIG")
            CTRAIN_STORE=$endpoint
            CTRAIN_LAUNCH=(
                torchrun
                --nnodes="$CTRAIN_NNODES"
                --nproc-per-node="$CTRAIN_NPROC_PER_NODE"
                --rdzv-backend=c10d
                --rdzv-endpoint="$endpoint"
                --rdzv-conf=is_host=false # the store is a process of its own (CTRAIN_TASK)
                --rdzv-id="$SLURM_JOB_ID"
                "${program[@]}"
                "${train[@]}"
            )
            ;;
        accelerate)
            # --machine_rank is added on each node (CTRAIN_TASK): only there is SLURM_NODEID known.
            CTRAIN_LAUNCH=(
                accelerate launch
                --multi_gpu
                --num_machines="$CTRAIN_NNODES"
                --num_processes="$((CTRAIN_NNODES * CTRAIN_NPROC_PER_NODE))"
                --main_process_ip="$CTRAIN_MASTER_ADDR"
                --main_process_port="$CTRAIN_MASTER_PORT"
                --rdzv_backend=c10d
            )
            [[ -z $CTRAIN_ACCELERATE_CONFIG ]] || CTRAIN_LAUNCH+=(--config_file="$CTRAIN_ACCELERATE_CONFIG")
            ((${#program[@]} == 0)) || CTRAIN_LAUNCH+=(--no_python)
            CTRAIN_LAUNCH+=("${train[@]}")
            ;;
    esac
}

# What each srun task runs, once per node, inside the container (`sh -c`: any image has a POSIX
# shell; the launcher's words follow as "$@"). Only here are the node's own values known.
# - enroot's PyTorch hook (pyxis, images with PYTORCH_VERSION) sets RANK, WORLD_SIZE, MASTER_* from
#   SLURM_* as if each task were one worker: unset, so only torchrun's own values reach the workers.
# - The launcher's PID goes to CTRAIN_RUN_DIR (in the project directory, the working directory), so
#   the time-limit warning can be handed to its workers and to nothing else (ctrain_forward).
# - A stray USR1 must not kill the launcher: it ignores it (ignoring survives exec; the workers
#   install their own handler). TERM, which Slurm sends to every process of the step, reaches the
#   launcher and its workers; the task waits for them.
# - When the launcher has ended, "EXIT-CODE HOSTNAME" goes to CTRAIN_RUN_DIR/node-N.done: the batch
#   script learns from it that a node's launcher failed (ctrain_guard) and which nodes never ended.
# - With CTRAIN_STORE=HOST:PORT the first node also hosts torchrun's rendezvous store, in a process
#   of its own that outlives its launcher until every node's launcher has exited (their `.done`
#   files), at most 30 s more. Hosted inside the first launcher, as torchrun does
#   by default, the store died with it while the other launchers were still in their exit barrier,
#   and a finished run ended in "Error waiting on exit barrier ... Failed to recv" and a C++ stack
#   trace (pytorch#69520).
ctrain_program CTRAIN_TCP_STORE tcp-store.py
ctrain_program CTRAIN_TASK task.sh
CTRAIN_TASK=${CTRAIN_TASK/@CTRAIN_TCP_STORE@/$CTRAIN_TCP_STORE}
