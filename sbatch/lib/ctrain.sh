# ctrain's sbatch library, sourced by the scripts in sbatch/ (`ctrain submit` inlines it, so the
# job does not depend on this file after submission). It turns what Slurm allocated into one
# launcher per node, inside the training image:
#
#   srun (one task per node) -> apptainer exec | pyxis container -> torchrun -> one worker per GPU
#
# Steps, one function each, in the order ctrain_main runs them:
#   ctrain_settings     CTRAIN_* variables and their defaults (docs/sbatch.md lists them all)
#   ctrain_allocation   nodes, processes per node, rendezvous address and port, from the allocation
#   ctrain_environment  unbuffered Python, threads per process, shutdown timeout, AWS EFA
#   ctrain_container    `apptainer exec ...` words, or pyxis's `srun --container-*` options
#   ctrain_launcher     torchrun (default), accelerate launch, or DeepSpeed through torchrun
#   ctrain_run          srun; forward the time-limit signal; requeue when the run asks for it
#
# Nothing here states a size: nodes come from SLURM_NNODES, processes per node from the GPUs
# (else the tasks) Slurm gave each node, so the same script runs 1, 2 or 16 nodes unchanged.

# The library's version: `ctrain submit` compares a project's copy (from `ctrain init`) with its own
# and says what the project misses. One line per version, newest last:
#   version 1: (no version line) the batch script decides failures; apptainer unpacks per job
#   version 2: the container gets only the host variables a job needs (CTRAIN_PASS_ENV); a node-local
#              image cache; torch.compile's caches in the project's .cache; each rank's own exit
#              record decides, so a NaN loss, a recipe error or an exception in the training code
#              ends the job at once instead of costing a retry
#   version 3: one decision per run, made once (the run's states: CTRAIN_LIFE); a batch host that dies
#              slowly, or a step that fails with no cause, is decided and named instead of left silent
#   version 4: the job's timeline (.ctrain/JOBID.timeline), from which `ctrain report JOB` accounts
#              for the job's time across requeues (queue, start-up, training, lost work)
#   version 5: a node that goes silent without failing anything (frozen, cut off the network) is found
#              within a minute (CTRAIN_NODE_CHECK) and left out of the requeue, instead of a 600 s hang
CTRAIN_LIB_VERSION=5

# --- settings -------------------------------------------------------------------------------------

# Where the image expects the project: mounted there, and the working directory (containers/Dockerfile).
CTRAIN_WORKDIR=/workspace

# ctrain_settings RUNTIME [RECIPE] [KEY=VALUE ...] | RUNTIME -- COMMAND [ARG ...]
ctrain_settings() {
    CTRAIN_RUNTIME=$1
    shift
    : "${CTRAIN_PROJECT_DIR:=${SLURM_SUBMIT_DIR:-$PWD}}" # mounted at CTRAIN_WORKDIR
    case $CTRAIN_RUNTIME in
        apptainer) : "${CTRAIN_IMAGE:=${IMAGE:-images/ctrain-latest.sif}}" ;;
        pyxis) : "${CTRAIN_IMAGE:=${IMAGE:-images/ctrain-latest.sqsh}}" ;; # or a registry reference
        *) ctrain_die "unknown runtime '$CTRAIN_RUNTIME'; valid: apptainer, pyxis" ;;
    esac
    : "${CTRAIN_RECIPE:=recipes/demo-addition.yaml}"
    : "${CTRAIN_LAUNCHER:=torchrun}"             # torchrun | accelerate | deepspeed
    : "${CTRAIN_DEEPSPEED_CONFIG:=configs/deepspeed/zero2.json}"
    : "${CTRAIN_ACCELERATE_CONFIG:=}"            # an `accelerate config` file; empty: flags only
    : "${CTRAIN_DATA:=}"                         # host directory mounted at /data; empty: none
    : "${CTRAIN_HF_CACHE:=${HF_HOME:-$HOME/.cache/huggingface}}" # mounted at /hf_home (HF_HOME)
    : "${CTRAIN_OUTPUTS:=$CTRAIN_PROJECT_DIR/outputs}" # mounted at /outputs
    : "${CTRAIN_MOUNTS:=}"                       # more SRC:DST[:ro],... mounts
    : "${CTRAIN_MOUNT_HOME:=0}"                  # 1: mount $HOME in the container
    : "${CTRAIN_CONTAINER_ENV:=}"                # NAME,... whose host values win over the image's
    : "${CTRAIN_PASS_ENV:=}"                     # NAME,PREFIX_*,... more host variables the container gets
    : "${CTRAIN_EFA:=0}"                         # 1: AWS EFA settings for NCCL (see ctrain_environment)
    : "${CTRAIN_REQUEUE_EXIT:=75}"               # the trainer's "checkpointed, requeue me" exit code
    : "${CTRAIN_MAX_REQUEUES:=10}"               # stop requeueing after this many restarts
    : "${CTRAIN_HANG_TIMEOUT:=600}"              # seconds without a finished step before a rank counts as hung; 0: off
    : "${CTRAIN_STEP_GRACE:=10}"                 # seconds the other nodes get to end after one node's launcher failed
    : "${CTRAIN_NODE_CHECK:=30}"                 # seconds without a finished step before every node is asked; 0: off
    : "${CTRAIN_APPTAINER_UNSQUASH:=1}"          # 1: run a SIF from a node-local copy (see ctrain_container_apptainer)
    : "${CTRAIN_IMAGE_CACHE:=${APPTAINER_TMPDIR:-${TMPDIR:-/tmp}}/ctrain-images-$(id -u)}" # node-local unpacked images
    : "${CTRAIN_IMAGE_CACHE_GB:=50}"             # the cache's size limit on each node, in GiB
    : "${CTRAIN_PREFLIGHT:=quick}"               # off | quick | full: the checks before the first step (ctrain_preflight)
    : "${CTRAIN_PREFLIGHT_TMP_MB:=1024}"         # node-local scratch (TMPDIR) a node must have free, in MiB
    : "${CTRAIN_DRY_RUN:=0}"                     # 1: print the commands instead of running them

    # Files are given relative to the project directory; the containers need absolute paths
    # (pyxis reads a relative image path as a registry reference). pyxis takes a registry
    # reference in enroot's spelling (nvcr.io#nvidia/pytorch:TAG), users copy Docker's.
    if ctrain_image_is_file "$CTRAIN_IMAGE"; then
        CTRAIN_IMAGE=$(ctrain_abspath "$CTRAIN_IMAGE")
    elif [[ $CTRAIN_RUNTIME == pyxis ]]; then
        CTRAIN_IMAGE=$(ctrain_enroot_image "$CTRAIN_IMAGE")
    fi
    CTRAIN_HF_CACHE=$(ctrain_abspath "$CTRAIN_HF_CACHE")
    CTRAIN_OUTPUTS=$(ctrain_abspath "$CTRAIN_OUTPUTS")
    [[ -z $CTRAIN_DATA ]] || CTRAIN_DATA=$(ctrain_abspath "$CTRAIN_DATA")

    # Arguments: a recipe first (anything without '='), then KEY=VALUE recipe overrides; or `--`
    # and a command of your own (ctrain_launcher says how each form starts).
    CTRAIN_COMMAND=()
    if [[ ${1-} == -- ]]; then
        shift
        (($# > 0)) || ctrain_die "nothing after --: give the command to run, e.g. -- train.py --lr 1e-4"
        CTRAIN_COMMAND=("$@")
        set --
    elif [[ $# -gt 0 && $1 != *=* ]]; then
        CTRAIN_RECIPE=$1
        shift
    fi
    CTRAIN_OVERRIDES=("$@")
    # The project directory is the container's working directory: recipes in it are given relative.
    if [[ $CTRAIN_RECIPE == "$CTRAIN_PROJECT_DIR"/* ]]; then
        CTRAIN_RECIPE=${CTRAIN_RECIPE#"$CTRAIN_PROJECT_DIR"/}
    fi
    # A number: it reaches the nodes' shell arithmetic (CTRAIN_IMAGE_PREPARE).
    [[ $CTRAIN_IMAGE_CACHE_GB =~ ^[0-9]{1,9}$ ]] ||
        ctrain_die "CTRAIN_IMAGE_CACHE_GB is '$CTRAIN_IMAGE_CACHE_GB'; give the image cache's size in GiB (e.g. 50)"
    case $CTRAIN_PREFLIGHT in
        off | quick | full) ;;
        *) ctrain_die "CTRAIN_PREFLIGHT is '$CTRAIN_PREFLIGHT'; valid: off, quick, full" ;;
    esac
    [[ $CTRAIN_PREFLIGHT_TMP_MB =~ ^[0-9]{1,9}$ ]] ||
        ctrain_die "CTRAIN_PREFLIGHT_TMP_MB is '$CTRAIN_PREFLIGHT_TMP_MB'; give the node-local space a job needs in MiB (e.g. 1024)"
    case $CTRAIN_LAUNCHER in
        torchrun | accelerate | deepspeed) ;;
        *) ctrain_die "CTRAIN_LAUNCHER is '$CTRAIN_LAUNCHER'; valid: torchrun, accelerate, deepspeed" ;;
    esac
    # Names and globs: they become patterns and srun's --export list (ctrain_task_env).
    [[ $CTRAIN_PASS_ENV =~ ^[A-Za-z0-9_*,]*$ ]] ||
        ctrain_die "CTRAIN_PASS_ENV is '$CTRAIN_PASS_ENV'; give variable names or NAME_* prefixes, separated by commas"
}

# The host variables each task, and so the container, gets (srun --export): what Slurm, the
# launcher, NCCL, the training stack, Apptainer and ctrain read, a proxy and a locale, and what
# CTRAIN_PASS_ENV and slurm.env (CTRAIN_CONTAINER_ENV) name. Not PYTHONPATH, LD_LIBRARY_PATH,
# PYTHONHOME, conda's or a module's variables: from `module load` or ~/.bashrc on the node they
# would reach Python in the image (Apptainer resets PATH and LD_LIBRARY_PATH itself; pyxis keeps
# the image's values over the host's, for variables the image sets).
CTRAIN_PASSED_ENV=(CTRAIN_* SLURM_* SLURMD_* PMI_* PMIX_* OMPI_* APPTAINER* SINGULARITY* ENROOT_* PYXIS_*
    NCCL_* FI_* UCX_* CUDA_* NVIDIA_* HF_* HUGGING_FACE_* TRANSFORMERS_* TORCH* PYTORCH_* TRITON_* ACCELERATE_*
    DS_* OMP_* MKL_* KMP_* WANDB_* MLFLOW_* TENSORBOARD_* PYTHONUNBUFFERED PYTHONNOUSERSITE PYTHONHASHSEED
    XDG_CACHE_HOME TMPDIR PATH HOME USER LOGNAME LANG LC_* TERM TZ http_proxy https_proxy no_proxy HTTP_PROXY
    HTTPS_PROXY NO_PROXY SSL_CERT_FILE SSL_CERT_DIR REQUESTS_CA_BUNDLE CURL_CA_BUNDLE)

# ctrain_task_env: the names of the variables set here that a task gets, comma-separated.
ctrain_task_env() {
    local name pattern patterns=("${CTRAIN_PASSED_ENV[@]}" "${CTRAIN_FORCED_ENV[@]}") names=()
    local yours="$CTRAIN_PASS_ENV,$CTRAIN_CONTAINER_ENV"
    IFS=, read -ra yours <<<"$yours"
    patterns+=("${yours[@]}")
    while IFS= read -r name; do
        for pattern in "${patterns[@]}"; do
            # shellcheck disable=SC2053 # the pattern is a glob on purpose
            if [[ -n $pattern && $name == $pattern ]]; then
                names+=("$name")
                break
            fi
        done
    done < <(compgen -e)
    (IFS=,; echo "${names[*]}")
}

# --- allocation -----------------------------------------------------------------------------------

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
            # which containers on Slurm do not have. A command of your own takes its DeepSpeed
            # config in its own arguments (--deepspeed FILE, as HF's scripts do).
            [[ $CTRAIN_LAUNCHER == torchrun || ${#CTRAIN_COMMAND[@]} -gt 0 ]] ||
                train+=("training.deepspeed=$CTRAIN_DEEPSPEED_CONFIG")
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
# - The launcher's PID goes to CTRAIN_PIDS (in the project directory, the working directory), so
#   the time-limit warning can be handed to its workers and to nothing else (ctrain_forward).
# - A stray USR1 must not kill the launcher: it ignores it (ignoring survives exec; the workers
#   install their own handler). TERM, which Slurm sends to every process of the step, reaches the
#   launcher and its workers; the task waits for them.
# - When the launcher has ended, "EXIT-CODE HOSTNAME" goes to CTRAIN_PIDS/node-N.done: the batch
#   script learns from it that a node's launcher failed (ctrain_guard) and which nodes never ended.
# - With CTRAIN_STORE=HOST:PORT the first node also hosts torchrun's rendezvous store, in a process
#   of its own that outlives its launcher until every node's launcher has exited (their `.done`
#   files), at most 30 s more. Hosted inside the first launcher, as torchrun does
#   by default, the store died with it while the other launchers were still in their exit barrier,
#   and a finished run ended in "Error waiting on exit barrier ... Failed to recv" and a C++ stack
#   trace (pytorch#69520).
CTRAIN_TASK='unset RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT
trap "" USR1
if [ "$1" = accelerate ]; then shift 2; set -- accelerate launch --machine_rank="$SLURM_NODEID" "$@"; fi
echo "ctrain: $(uname -n): $*"
store=
if [ -n "${CTRAIN_STORE:-}" ] && [ "${SLURM_NODEID:-0}" = 0 ]; then
    python3 -c "
import datetime, signal, sys
import torch.distributed as dist
signal.signal(signal.SIGTERM, signal.SIG_IGN)
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False,
                      multi_tenant=True, timeout=datetime.timedelta(seconds=300))
while True:
    signal.pause()
" "${CTRAIN_STORE%:*}" "${CTRAIN_STORE##*:}" &
    store=$!
fi
trap : TERM
"$@" &
launcher=$!
echo $launcher >"$CTRAIN_PIDS/$(uname -n).pid"
echo "${SLURM_STEP_ID:-0}" >"$CTRAIN_PIDS/step"
wait $launcher
rc=$?
while kill -0 $launcher 2>/dev/null; do wait $launcher; rc=$?; done
echo "$rc $(uname -n)" >"$CTRAIN_PIDS/node-${SLURM_NODEID:-0}.done"
if [ -n "$store" ]; then
    waited=0
    while [ "$(ls "$CTRAIN_PIDS" | grep -c "[.]done$")" -lt "${SLURM_STEP_NUM_NODES:-1}" ] &&
        [ $waited -lt 300 ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    kill -9 $store
fi
exit $rc'

# --- run ------------------------------------------------------------------------------------------

ctrain_run() {
    CTRAIN_SRUN=(
        srun
        --label                     # "N: " before each line: N is the node (one task per node)
        --kill-on-bad-exit=1        # one node failing ends the step everywhere
        --nodes="$CTRAIN_NNODES"
        --ntasks="$CTRAIN_NNODES"
        --ntasks-per-node=1         # one launcher per node starts the node's workers
    )
    export CTRAIN_PIDS=.ctrain/$SLURM_JOB_ID    # relative to the project directory, on every node
    export CTRAIN_HEARTBEATS=$CTRAIN_PIDS/heartbeat # each rank's progress, written by the trainer
    export CTRAIN_EXITS=$CTRAIN_PIDS/exit           # why each rank ended, written by the trainer
    export CTRAIN_TIMELINE=.ctrain/$SLURM_JOB_ID.timeline # the job's events, kept across requeues
    # Only the variables the job needs (ctrain_task_env, so after every export the tasks read); the
    # first node's task (CTRAIN_TASK) also gets the rendezvous store's address, to host it.
    CTRAIN_SRUN+=(--export="$(ctrain_task_env)${CTRAIN_STORE:+,CTRAIN_STORE=$CTRAIN_STORE}")
    CTRAIN_SRUN+=(
        "${CTRAIN_SRUN_CONTAINER[@]}"
        "${CTRAIN_CONTAINER[@]}"
        sh -c "$CTRAIN_TASK" ctrain-task
        "${CTRAIN_LAUNCH[@]}"
    )
    ctrain_show "${CTRAIN_SRUN[@]}"
    [[ $CTRAIN_DRY_RUN != 1 ]] || return 0

    CTRAIN_SIGNAL=
    rm -rf "${CTRAIN_PROJECT_DIR:?}/$CTRAIN_PIDS" # what a killed run of this job left
    mkdir -p "$CTRAIN_PROJECT_DIR/$CTRAIN_HEARTBEATS"
    ctrain_mark start "$(ctrain_submitted)" "$CTRAIN_NNODES" "${SLURM_GPUS_ON_NODE:-0}"
    local dir=$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS rc
    if ! ctrain_preflight; then
        ctrain_decide "$dir" 1 unfit
        ctrain_run_end
        return 1
    fi
    [[ -z $CTRAIN_IMAGE_ENTRY ]] || ctrain_image_cache
    ctrain_mark launched
    "${CTRAIN_SRUN[@]}" &
    CTRAIN_STEP_PID=$!
    ctrain_transition launched
    local watchdog= guard alive= sentinel=
    if ((CTRAIN_NNODES > 1)); then
        ctrain_alive &
        alive=$!
        ctrain_sentinel_step &
        sentinel=$!
    fi
    if ((CTRAIN_HANG_TIMEOUT > 0 || (CTRAIN_NNODES > 1 && CTRAIN_NODE_CHECK > 0))); then
        ctrain_watchdog &
        watchdog=$!
    fi
    ctrain_guard &
    guard=$!
    # #SBATCH --signal=B:USR1@SECONDS warns this shell (only) before the time limit: pass it on.
    trap 'ctrain_forward USR1' USR1
    # Preemption and scancel send TERM to every process of the job themselves: keep waiting
    # for the workers' checkpoint instead of dying first.
    trap 'CTRAIN_SIGNAL=TERM; ctrain_transition terminated' TERM
    while :; do
        wait "$CTRAIN_STEP_PID"
        rc=$?
        kill -0 "$CTRAIN_STEP_PID" 2>/dev/null || break # wait returned early for a trapped signal
    done
    trap - USR1 TERM
    [[ -z $watchdog ]] || kill "$watchdog" 2>/dev/null
    kill "$guard" 2>/dev/null
    echo "ctrain: step exited with $rc${CTRAIN_SIGNAL:+ after SIG$CTRAIN_SIGNAL}"
    ctrain_mark exited "$rc"
    ctrain_decide "$dir" "$rc" exited
    # The sentinel watches until the decision is made: a batch host lost while deciding is still seen.
    if [[ -n $sentinel ]]; then
        kill "$alive" 2>/dev/null
        wait "$alive" 2>/dev/null
        ctrain_stop "$sentinel"
    fi
    ctrain_run_end
    return "$rc"
}

# ctrain_run_end: what a run leaves once it is decided.
ctrain_run_end() {
    rm -rf "${CTRAIN_PROJECT_DIR:?}/$CTRAIN_PIDS"
    # The one retry after a failed rank counts for the whole job, across requeues.
    [[ -n $CTRAIN_REQUEUED ]] || rm -f "$CTRAIN_PROJECT_DIR/.ctrain/$SLURM_JOB_ID.retried"
    rmdir "$CTRAIN_PROJECT_DIR/.ctrain" 2>/dev/null
}

# --- preflight ------------------------------------------------------------------------------------

# Before each run's training step, unless CTRAIN_PREFLIGHT=off, each node is checked on its host
# (ctrain_preflight), and every rank of `ctrain train` checks its GPU and the network once the
# process group is up (src/ctrain/train/health.py; CTRAIN_PREFLIGHT=full runs those longer). A node
# that fails a check is written to CTRAIN_PIDS/unfit ("HOST CHECK MESSAGE"), and ctrain_decide
# requeues the job without it, as it does a lost node. docs/reliability.md lists the checks.
#
# What runs on each node's host ($1 the project directory, $2 the batch host's token, $3 the MiB of
# TMPDIR a job needs, $4 the image's cache entry or "", $5 the MiB unpacking it takes): one line per
# failed check, "unfit NODE CHECK MESSAGE", then "ok NODE SUMMARY". POSIX sh and coreutils only.
CTRAIN_PREFLIGHT_NODE='project=$1 token=$2 tmp_mib=$3 entry=$4 entry_mib=$5 node=${SLURMD_NODENAME:-$(uname -n)}
unfit() { echo "unfit $node $1 $2"; }
mib_free() { df -Pk "$1" 2>/dev/null | awk "NR == 2 { print int(\$4 / 1024) }"; }
shared=$project/.ctrain/$SLURM_JOB_ID.preflight
if [ "$(cat "$shared" 2>/dev/null)" != "$token" ]; then
    unfit shared "$shared is missing or different on this node: $project is not the file system the batch host writes"
elif ! echo "$token" 2>/dev/null >"$shared.$node"; then
    unfit shared "cannot write in $project/.ctrain from this node"
fi
rm -f "$shared.$node"
tmp=${TMPDIR:-/tmp}
free=$(mib_free "$tmp")
if [ -z "$free" ]; then
    unfit disk "cannot read the free space of TMPDIR $tmp"
elif [ "$free" -lt "$tmp_mib" ]; then
    unfit disk "TMPDIR $tmp has $free MiB free, the job needs $tmp_mib MiB of node-local scratch (CTRAIN_PREFLIGHT_TMP_MB)"
elif ! probe=$(mktemp "$tmp/ctrain-preflight.XXXXXX" 2>/dev/null); then
    unfit disk "cannot create a file in TMPDIR $tmp"
else
    rm -f "$probe"
fi
summary="TMPDIR $free MiB free"
if [ -n "$entry" ] && [ ! -e "$entry/complete" ]; then
    dir=$entry
    while [ ! -d "$dir" ]; do dir=$(dirname "$dir"); done
    room=$(mib_free "$dir")
    if [ -n "$room" ] && [ "$room" -lt "$entry_mib" ]; then
        unfit disk "the image cache $dir has $room MiB free, unpacking the image takes about $entry_mib MiB (CTRAIN_IMAGE_CACHE)"
    fi
fi
gpus=${SLURM_GPUS_ON_NODE:-0}
case $gpus in "" | *[!0-9]*) gpus=0 ;; esac
if [ "$gpus" -gt 0 ] && command -v nvidia-smi >/dev/null 2>&1; then
    if ! out=$(nvidia-smi --query-gpu=index,ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits 2>&1); then
        unfit gpu "nvidia-smi fails: $(echo "$out" | tail -n 1)"
    else
        seen=$(echo "$out" | grep -c .)
        [ "$seen" -ge "$gpus" ] || unfit gpu "nvidia-smi sees $seen GPU(s), the job was given $gpus"
        echo "$out" | while IFS=", " read -r index ecc; do
            case $ecc in "" | 0 | *[!0-9]*) ;; *) unfit gpu "GPU $index has $ecc uncorrected ECC errors since the driver loaded (nvidia-smi -q -d ECC)" ;; esac
        done
        nvidia-smi --query-gpu=index,remapped_rows.pending --format=csv,noheader 2>/dev/null | while IFS=", " read -r index pending; do
            [ "$pending" != Yes ] || unfit gpu "GPU $index has a row remapping pending: reset it (nvidia-smi -r) before it trains"
        done
        summary="$summary, $seen GPU(s), driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
    fi
fi
echo "ok $node $summary"'

# ctrain_preflight: the node checks above on every node of the job, at once; returns 1 when a node
# is unfit (recorded in CTRAIN_PIDS/unfit) or gave no answer. The answers come back through srun,
# not through the shared file system that one of the checks doubts.
ctrain_preflight() {
    [[ $CTRAIN_PREFLIGHT != off ]] || return 0
    local dir=$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS token=$RANDOM$RANDOM$RANDOM started=${EPOCHREALTIME/[^0-9]/.}
    local shared=$CTRAIN_PROJECT_DIR/.ctrain/$SLURM_JOB_ID.preflight entry= need=0 kind host check message
    local answered=() nodes=() node seconds
    echo "$token" >"$shared" || ctrain_die "cannot write $shared: the project directory must be writable"
    if [[ -n $CTRAIN_IMAGE_ENTRY && -f $CTRAIN_IMAGE ]]; then
        entry=$CTRAIN_IMAGE_ENTRY
        need=$(($(stat -c %s "$CTRAIN_IMAGE") * 3 / 1048576 + 1)) # a SIF unpacks to about 2-3 times its size
    fi
    while read -r kind host check message; do
        case $kind in
            ok) answered+=("$host") && echo "ctrain: preflight: $host: $check $message" ;;
            unfit)
                echo "ctrain: preflight: $host: unfit: $check: $message"
                echo "$host $check $message" >>"$dir/unfit"
                ;;
            "") ;;
            *) echo "ctrain: preflight: $kind $host $check $message" ;; # srun's own lines
        esac
    done < <(ctrain_on_nodes "$CTRAIN_PREFLIGHT_NODE" "$CTRAIN_PROJECT_DIR" "$token" "$CTRAIN_PREFLIGHT_TMP_MB" \
        "$entry" "$need" 2>&1)
    rm -f "$shared"
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    for node in "${nodes[@]}"; do
        [[ " ${answered[*]} " == *" $node "* ]] && continue
        echo "ctrain: preflight: $node: unfit: answer: its checks did not run or did not answer (ctrain_on_nodes)"
        echo "$node answer its checks did not run or did not answer" >>"$dir/unfit"
    done
    seconds=$(awk -v a="$started" -v b="${EPOCHREALTIME/[^0-9]/.}" 'BEGIN { printf "%.2f", b - a }')
    if [[ -s $dir/unfit ]]; then
        ctrain_mark preflight "$seconds" "$(wc -l <"$dir/unfit")"
        return 1
    fi
    echo "ctrain: preflight: ${#nodes[@]} node(s) fit in $seconds s"
    ctrain_mark preflight "$seconds" 0
}

# --- the run's life -------------------------------------------------------------------------------
#
# One run (one start of the job) moves through these states; ctrain_transition EVENT is the only
# writer of CTRAIN_PIDS/state ("RESTART STATE"), and an event the table has no entry for, from the
# current state, changes nothing and fails with a line saying so. Who sends each event:
#   launched     ctrain_run, once the training step's srun started
#   warned       ctrain_forward: Slurm's USR1 before the time limit, passed to the workers
#   terminated   ctrain_run's TERM trap: Slurm's TERM (scancel, scontrol requeue, preemption)
#   ending       ctrain_guard (a launcher failed, a node does not answer), ctrain_silent (no progress, a
#                node does not answer), ctrain_hung (a hang)
#   exited       ctrain_decide in the batch script, after the step's srun exited
#   batch-gone   ctrain_decide in the sentinel: the batch script is gone (its host lost, or the job
#                left RUNNING) before it decided
#   requeued, left (Slurm's TERM: Slurm decides), finished, ended   ctrain_decide's outcome
# The decided states (requeued, left, finished, ended) have no way out: a second decider (the
# sentinel after the batch script, or the reverse) is refused, so the job's fate is decided once.
# docs/architecture.md draws the table; a unit test walks every entry.
declare -A CTRAIN_LIFE=(
    [starting:launched]=running
    [starting:unfit]=deciding
    [running:warned]=running
    [running:terminated]=terminating
    [running:ending]=ending
    [running:exited]=deciding
    [running:batch-gone]=deciding
    [ending:warned]=ending
    [ending:terminated]=terminating
    [ending:ending]=ending
    [ending:exited]=deciding
    [ending:batch-gone]=deciding
    [terminating:warned]=terminating
    [terminating:terminated]=terminating
    [terminating:ending]=terminating
    [terminating:exited]=deciding
    [deciding:batch-gone]=deciding
    [deciding:requeued]=requeued
    [deciding:left]=left
    [deciding:finished]=finished
    [deciding:ended]=ended
)

# A node dying slowly (out of memory, a failing disk) loses its processes over seconds, in any order,
# while its slurmd may answer until the last: a failure that nothing explains is attributed to a node
# only after this many seconds (ctrain_decide, ctrain_sentinel).
CTRAIN_SETTLE=3

# ctrain_state: this run's state (starting before any transition, or when the file is another run's).
ctrain_state() {
    local run state
    read -r run state 2>/dev/null <"$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS/state" &&
        [[ $run == "${SLURM_RESTART_COUNT:-0}" && -n $state ]] || state=starting
    echo "$state"
}

# ctrain_transition EVENT: move this run along CTRAIN_LIFE, or fail (nothing changed) where the
# table has no entry for EVENT from the current state.
ctrain_transition() {
    local file=$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS/state state next
    state=$(ctrain_state)
    next=${CTRAIN_LIFE[$state:$1]-}
    if [[ -z $next ]]; then
        echo "ctrain: the run is $state: '$1' is not one of its transitions (CTRAIN_LIFE); nothing done"
        return 1
    fi
    { echo "${SLURM_RESTART_COUNT:-0} $next" >"$file.$BASHPID" && mv -f "$file.$BASHPID" "$file"; } 2>/dev/null && return
    # The shared file system is full: a new file needs room, rewriting the state file's own few bytes
    # does not (its block is freed and taken again). Without this no decision is recorded, so none is
    # made, and a preempted run that asked to be requeued would just end.
    rm -f "$file.$BASHPID"
    echo "${SLURM_RESTART_COUNT:-0} $next" 2>/dev/null >"$file" && return
    echo "ctrain: cannot record the run's state ($next) in $file: is its file system full (df $CTRAIN_PROJECT_DIR)?"
    return 1
}

# ctrain_mark EVENT [ARG...]: one line of the job's timeline (CTRAIN_TIMELINE, kept across
# requeues): `EPOCH RESTART EVENT ARG...`. The batch script (and a sentinel deciding in its place)
# marks each run's start, launch, step end and decision; rank 0 marks what the trainer does
# (ctrain.train.goodput, which also names every event). `ctrain report JOB` reads it.
ctrain_mark() {
    [[ ${CTRAIN_DRY_RUN:-0} != 1 && -n ${CTRAIN_TIMELINE:-} ]] || return 0
    echo "$(date +%s.%N) ${SLURM_RESTART_COUNT:-0} $*" >>"$CTRAIN_PROJECT_DIR/$CTRAIN_TIMELINE" 2>/dev/null || true
}

# ctrain_submitted: when Slurm last queued the job (its SubmitTime, which a requeue renews), as
# seconds since the epoch; "-" when the controller does not say.
ctrain_submitted() {
    local when
    when=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.* SubmitTime=\([0-9T:-]*\) .*/\1/p')
    date -d "${when:-none}" +%s 2>/dev/null || echo -
}

# ctrain_failed_node DIR: "EXIT-CODE HOST" of the node whose launcher failed first (an exit code
# other than 0 and CTRAIN_REQUEUE_EXIT in its node-N.done), nothing when none did.
ctrain_failed_node() {
    local file rc host
    while read -r file; do
        read -r rc host <"$file" || continue
        [[ $rc == 0 || $rc == "$CTRAIN_REQUEUE_EXIT" ]] || { echo "$rc $host"; return; }
    done < <(ls -1tr "$1"/node-*.done 2>/dev/null)
}

# ctrain_decide DIR RC EVENT: the run's fate, decided once, by the batch script after the step
# (EVENT exited: srun exited RC) or by the sentinel in its place (batch-gone), from what the step left
# in DIR (CTRAIN_PIDS) and the signal the batch script got; most specific cause first:
#   a lost node (ctrain_guard's or the sentinel's `lost`, or, after a step that failed with no
#   rank's record to explain it, a node that does not answer CTRAIN_SETTLE seconds later): requeue
#   without it;
#   a rank's own record that a retry cannot help (ctrain_rank_exit): end;
#   a hang (the watchdog's `hung`), a launcher that failed on a live node, or a failed step that
#   nothing explains: retry once;
#   else requeue when the run or Slurm's warning asked for it.
# One `ctrain: failure:` line names the cause. The run's state (ctrain_transition) makes it once: a
# second decider finds the run decided, or deciding on a live host, and does nothing.
ctrain_decide() {
    local dir=$1 rc=$2 event=$3 hung= lost= failed final nodes=() outcome cause=${CTRAIN_SIGNAL:-none} unfit
    ctrain_transition "$event" || return 0
    [[ ! -e $dir/hung ]] || hung=1
    [[ ! -e $dir/lost ]] || lost=$(sort -u "$dir/lost" | paste -sd' ')
    failed=$(ctrain_failed_node "$dir")
    final=$(ctrain_rank_exit "$dir/exit")
    unfit=$(ctrain_unfit_nodes "$dir/unfit")
    CTRAIN_REQUEUED=
    if [[ -z $unfit && -z $lost && -z $final && $rc != 0 && $rc != "$CTRAIN_REQUEUE_EXIT" && $CTRAIN_SIGNAL != TERM ]]; then
        # A node dying slowly takes its processes in any order (a launcher, this step's srun, the
        # guard) while its slurmd may still answer: after CTRAIN_SETTLE seconds every node is asked.
        sleep "$CTRAIN_SETTLE"
        mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
        ctrain_probe "${nodes[@]}"
        lost=${CTRAIN_UNANSWERED[*]}
    fi
    if [[ -n $unfit && -z $CTRAIN_SIGNAL ]]; then
        local host check message
        while read -r host check message; do
            echo "ctrain: failure: preflight: $host is unfit ($check): $message"
        done < <(head -n 20 "$dir/unfit")
        cause=preflight
        mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
        if ((${#nodes[@]} > 1)) && [[ $(wc -w <<<"$unfit") -ge ${#nodes[@]} ]]; then
            echo "ctrain: not requeueing: every node of the job failed the preflight, so the fault is the job's" \
                "(its image, its settings, the shared file system), not a node's: fix it and submit again"
        else
            # shellcheck disable=SC2086 # one word per node
            ctrain_requeue_without $unfit
        fi
    elif [[ -n $lost ]]; then
        echo "ctrain: failure: node lost: $lost (${CTRAIN_LOST_WHY:-its launcher never ended and its slurmd does not answer})"
        cause=node-lost
        # shellcheck disable=SC2086 # one word per node
        ctrain_requeue_without $lost
        # The job's end cannot reach Slurm from a lost batch host (or from a sentinel's decision):
        # without the scancel it would stay RUNNING until Slurm declares the node dead.
        if [[ -z $CTRAIN_REQUEUED && " $lost " == *" $CTRAIN_BATCH_HOST "* ]] && ctrain_job_is RUNNING PENDING; then
            echo "ctrain: ending job $SLURM_JOB_ID (scancel): its batch script was lost with $CTRAIN_BATCH_HOST"
            scancel "$SLURM_JOB_ID"
        fi
    elif [[ -n $final && -z $CTRAIN_SIGNAL ]]; then
        local rank code host message
        read -r rank code cause host message <<<"$final"
        echo "ctrain: failure: rank $rank on $host ended with $code ($cause): $message"
        echo "ctrain: not requeueing: a $cause failure repeats on a retry; fix it and submit again"
        cause=rank-$cause
    elif [[ -n $hung ]]; then
        echo "ctrain: failure: a rank stopped making progress (the 'hang:' lines above); the step was ended"
        cause=hang
        ctrain_retry_once
    elif [[ -n $failed && -z $CTRAIN_SIGNAL ]]; then
        echo "ctrain: failure: a rank failed on a live node: ${failed#* }'s launcher exited with ${failed%% *}" \
            "first (a rank killed, e.g. out of memory, or an error in the training code)"
        cause=rank-failed
        ctrain_retry_once
    elif [[ $rc != 0 && $rc != "$CTRAIN_REQUEUE_EXIT" && -z $CTRAIN_SIGNAL ]]; then
        echo "ctrain: failure: the training step ended with $rc and no node or rank said why (its srun or" \
            "launchers were killed, e.g. out of memory); every node answers"
        cause=step-failed
        ctrain_retry_once
    else
        ctrain_requeue_if_asked "$rc"
    fi
    if [[ -n $CTRAIN_REQUEUED ]]; then
        outcome=requeued
    elif [[ $CTRAIN_SIGNAL == TERM ]]; then
        outcome=left
    elif [[ $rc == 0 && -z $lost ]]; then
        outcome=finished
    else
        outcome=ended
    fi
    ctrain_transition "$outcome" && ctrain_mark decided "$outcome" "$cause"
}

# ctrain_unfit_nodes FILE: the job's nodes named in the preflight's unfit FILE (CTRAIN_PIDS/unfit),
# one line; a name that is not one of the job's nodes is ignored (the file is data, written by ranks).
ctrain_unfit_nodes() {
    [[ -s $1 ]] || return 0
    local nodes=() node names
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    names=$(cut -d' ' -f1 "$1" | head -n 1000 | sort -u)
    for node in "${nodes[@]}"; do
        grep -qxF -- "$node" <<<"$names" && echo "$node"
    done | paste -sd' '
}

# ctrain_unreported DIR: the hosts of the job whose launcher has not reported its end (no node-N.done).
ctrain_unreported() {
    local hosts=() node
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    for node in "${!hosts[@]}"; do
        [[ -e $1/node-$node.done ]] || echo "${hosts[node]}"
    done
}

# ctrain_probe NODE...: CTRAIN_UNANSWERED, the nodes whose slurmd does not answer, asked all at once.
# While the job runs: a short step on each (10 s). Once Slurm has ended or requeued it (the sentinel,
# after the batch script died before deciding): a connection to the node's slurmd port (5 s). The
# answer is an array, not output: on a dying node a command substitution's subshell can be killed
# and return nothing, which would read as "every node answers". A probe SIGKILLed before its time
# is up was killed on this node, which is dying: this node is counted, not the one it asked; and
# when this node does not answer its own probe, the others' silence is not believed either.
ctrain_probe() {
    local nodes=("$@") probes=() node port= addr started=$SECONDS here=${SLURMD_NODENAME:-$CTRAIN_BATCH_HOST}
    CTRAIN_UNANSWERED=()
    if ! ctrain_job_is RUNNING; then
        port=$(scontrol show config | sed -n 's/^SlurmdPort *= *\([0-9]*\)$/\1/p')
    fi
    for node in "${nodes[@]}"; do
        if [[ -z $port ]]; then
            timeout --signal=KILL 10 srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" true >/dev/null 2>&1 &
        else
            addr=$(scontrol show node -o "$node" | grep -o 'NodeAddr=[^ ]*')
            timeout --signal=KILL 5 bash -c ': <>"/dev/tcp/$0/$1"' "${addr#NodeAddr=}" "$port" >/dev/null 2>&1 &
        fi
        probes+=($!)
    done
    for node in "${!nodes[@]}"; do
        wait "${probes[node]}" && continue
        if (($? == 137 && SECONDS - started < 3)); then
            [[ " ${CTRAIN_UNANSWERED[*]} " == *" $here "* ]] || CTRAIN_UNANSWERED+=("$here")
        elif [[ " ${CTRAIN_UNANSWERED[*]} " != *" ${nodes[node]} "* ]]; then
            CTRAIN_UNANSWERED+=("${nodes[node]}")
        fi
    done
    # This node's own slurmd does not answer: it is dying, and its probes of the others fail with it
    # (seen in CI: a healthy node2 named lost with the dying batch host). Only this node is named.
    if [[ " ${CTRAIN_UNANSWERED[*]} " == *" $here "* ]]; then
        CTRAIN_UNANSWERED=("$here")
    fi
}

# ctrain_job_is STATE...: whether Slurm has the job in one of the STATEs (RUNNING, PENDING, ...).
ctrain_job_is() {
    local record state
    record=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null) || return 1
    for state; do
        [[ $record != *" JobState=$state "* ]] || return 0
    done
    return 1
}

# ctrain_rank_exit DIR: "RANK CODE CAUSE HOST MESSAGE" of the first rank (by time) whose own record
# in DIR (CTRAIN_EXITS, written by `ctrain train` as it ends: src/ctrain/train/exits.py) says a
# retry cannot change the outcome (a NaN loss, a recipe error, an exception in the training code);
# nothing when no rank's does. The record is data: it is only ever printed.
ctrain_rank_exit() {
    local file code cause retry host message
    while read -r file; do
        read -r code cause retry host message <"$file" || continue
        [[ $code != 0 && $retry == end ]] || continue
        echo "${file##*/rank-} $code $cause $host $message"
        return
    done < <(ls -1tr "$1"/rank-* 2>/dev/null)
}

# ctrain_guard (in the background, beside the step): end the step soon after one node's launcher
# failed. The other nodes' launchers normally follow within seconds (their collectives fail, and
# srun's --kill-on-bad-exit ends the rest), but a node that is gone cannot report: srun then waits
# for its task until slurmctld declares the node dead (SlurmdTimeout, 300 s by default), with no
# rank left anywhere. So after CTRAIN_STEP_GRACE seconds the nodes whose launcher has not ended
# are asked (a short step each) whether they answer; those that do not are lost (written to
# CTRAIN_PIDS/lost, for ctrain_run), and the step is ended: SIGKILL to what is left of it, then
# to srun. A step whose launchers have all ended is left alone (Apptainer may still be cleaning up).
ctrain_guard() {
    local dir=$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS failed= since
    local missing=() lost=()
    while [[ -z $failed ]]; do
        sleep 1
        failed=$(ctrain_failed_node "$dir")
    done
    since=$SECONDS
    while :; do
        mapfile -t missing < <(ctrain_unreported "$dir")
        ((${#missing[@]} > 0)) || return 0
        ((SECONDS - since < CTRAIN_STEP_GRACE)) || break
        sleep 1
    done
    ctrain_probe "${missing[@]}"
    lost=("${CTRAIN_UNANSWERED[@]}")
    echo "ctrain: ${failed#* }'s launcher exited with ${failed%% *}; ${CTRAIN_STEP_GRACE}s later" \
        "${missing[*]} had not ended${lost[*]:+, and ${lost[*]} does not answer}: ending the step"
    ((${#lost[@]} == 0)) || echo "${lost[*]}" >"$dir/lost"
    ctrain_transition ending
    ctrain_end_step
}

# ctrain_alive (in the background, on the batch host): a heartbeat for ctrain_sentinel, a number
# that changes every 2 s in CTRAIN_PIDS/batch-alive. Its content, not its time stamp, is compared,
# so a shared file system's attribute cache cannot make a live batch host look dead.
ctrain_alive() {
    local beat=0
    while :; do
        echo $((beat++)) >"$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS/batch-alive"
        sleep 2
    done
}

# What ctrain_sentinel runs on its node, which has only what ctrain_sentinel_step sends (`declare -f`).
CTRAIN_SENTINEL_NEEDS=(
    ctrain_sentinel ctrain_state ctrain_transition ctrain_decide ctrain_probe ctrain_job_is
    ctrain_failed_node ctrain_rank_exit ctrain_unfit_nodes ctrain_kill_step ctrain_requeue_without ctrain_requeue
    ctrain_retry_once ctrain_requeue_if_asked ctrain_mark
)

# ctrain_sentinel_step (in the background, beside the training step): ctrain_sentinel on the second
# node and, in a job of 3 nodes or more, on the last one too, on the host (not in the container: it
# needs Slurm's commands). The batch script decides what happens after a failure, but it runs on the
# first node, which is also the rendezvous host: when that node dies, the batch script dies with
# it, and without a sentinel the job would stay RUNNING with no trainer anywhere until Slurm
# declares the node dead (SlurmdTimeout), then wait, requeued, for that node. Two sentinels, so
# that losing the first two nodes at once (one switch, one power feed) is decided as well; the first
# of them to claim the decision (CTRAIN_PIDS/claim, made by mkdir, which is atomic on shared file
# systems) makes it. A sentinel writes straight to the job's log: srun, which would carry its
# output, ran on the lost node too.
# Each sentinel runs in a session of its own, no longer a child of its step's task (which waits for
# it): when the batch host dies, slurmctld may SIGKILL every step whose srun ran there, the
# sentinel's own step included, at once (seen on the testbed in about one run in four). Where Slurm
# tracks a step's processes by parentage (proctrack/linuxproc, pgid) that kill does not reach the
# sentinel; with proctrack/cgroup it does, and Slurm's own node-failure handling is left.
ctrain_sentinel_step() {
    local log hosts=() watchers count=1
    log=$(readlink -f /proc/$$/fd/1 2>/dev/null)
    [[ -f $log ]] || log=
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    watchers=${hosts[1]}
    ((${#hosts[@]} < 3)) || { watchers+=,${hosts[-1]} count=2; }
    local code
    code="$(declare -p CTRAIN_PROJECT_DIR CTRAIN_PIDS CTRAIN_NNODES CTRAIN_MAX_REQUEUES CTRAIN_STEP_GRACE \
        CTRAIN_REQUEUE_EXIT CTRAIN_BATCH_HOST CTRAIN_LIFE CTRAIN_SETTLE CTRAIN_TIMELINE CTRAIN_DRY_RUN)
$(declare -f "${CTRAIN_SENTINEL_NEEDS[@]}")
CTRAIN_SIGNAL=
ctrain_sentinel \"\$@\""
    [[ -z $log ]] || exec >/dev/null 2>&1 # srun's own lines (the step's end) would only be noise
    # shellcheck disable=SC2016 # expanded by the step's shell
    exec srun --overlap --nodes="$count" --ntasks="$count" --nodelist="$watchers" bash -c '
        pid=$( (setsid bash -c "$0" "$@" </dev/null >/dev/null 2>&1 & echo $!) )
        while kill -0 "$pid" 2>/dev/null; do sleep 1; done' "$code" ctrain-sentinel "$CTRAIN_BATCH_HOST" "$log"
}

# ctrain_sentinel BATCH-HOST LOG: decide in the batch script's place when it cannot. It watches the
# batch host's heartbeat from another node, and the run's state. The batch host is lost when its
# heartbeat has not changed for CTRAIN_STEP_GRACE seconds, or Slurm ended the sentinel's step (its
# srun ran there: a TERM while the run is undecided means just that, so the batch host is asked at
# once, well before the SIGKILL KillWait seconds later), and its slurmd does not answer either.
# A batch host that dies slowly may also take the batch script first while its slurmd still
# reports the death: Slurm then ends the job (FAILED) or requeues it with no decision made; an
# undecided run whose job left RUNNING is decided here as well. Either way ctrain_decide makes the
# decision, so it is the batch script's own: requeued without the lost node where the partition has
# enough other nodes, else ended (scancel), so that the job neither holds the other nodes until
# Slurm notices nor waits, requeued by Slurm, for the lost node. It ends itself once the run is
# decided (by either of them) or its directory is gone.
ctrain_sentinel() {
    local batch=$1 log=$2 dir=$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS beat last= seen=$SECONDS termed= why state record
    local restarts=${SLURM_RESTART_COUNT:-0} me=${SLURMD_NODENAME:-$(uname -n)} others=() node
    # The nodes lost with the batch host (one switch, one power feed) are asked at the same time.
    mapfile -t others < <(scontrol show hostnames "$SLURM_JOB_NODELIST" | grep -vx -e "$batch" -e "$me")
    [[ -z $log ]] || exec >>"$log" 2>&1
    trap 'termed=1' TERM
    while :; do
        sleep 1 &
        wait $!
        # The batch script removes the directory when its run ends; a requeued run makes it anew.
        [[ -d $dir ]] || return 0
        state=$(ctrain_state)
        case $state in
            running | ending | deciding) ;;
            *) return 0 ;; # decided, Slurm's TERM (Slurm decides), or a later run's
        esac
        beat=$(cat "$dir/batch-alive" 2>/dev/null)
        record=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null) || continue # slurmctld restarting: wait
        if [[ $record != *" JobState=RUNNING "* || $record != *" Restarts=$restarts "* ]]; then
            # Slurm ended or requeued the job, and the run is undecided: the batch script is gone,
            # maybe the first of its node's processes to go.
            sleep "$CTRAIN_SETTLE"
            ctrain_probe "$batch" "${others[@]}"
            why="the job left RUNNING undecided"
            # A run that is deciding, on a batch host that answers, may have requeued the job itself.
            [[ $state != deciding || " ${CTRAIN_UNANSWERED[*]} " == *" $batch "* ]] || return 0
            break
        elif [[ -n $termed ]]; then
            termed=
            why="Slurm ended the sentinel's step, whose srun ran there,"
        elif [[ $beat != "$last" ]]; then
            last=$beat seen=$SECONDS
            continue
        elif ((SECONDS - seen >= CTRAIN_STEP_GRACE)); then
            why="no heartbeat for ${CTRAIN_STEP_GRACE}s"
        else
            continue
        fi
        ctrain_probe "$batch" "${others[@]}"
        [[ " ${CTRAIN_UNANSWERED[*]} " != *" $batch "* ]] || break
        last=$beat seen=$SECONDS # the batch host answers: only its heartbeat was late
    done
    mkdir "$dir/claim" 2>/dev/null || return 0 # the other sentinel decides
    if [[ " ${CTRAIN_UNANSWERED[*]} " != *" $batch "* ]]; then
        # Only the job left RUNNING: its batch script died on a host that still answers.
        echo "ctrain: the batch script on $batch ended before it decided (the job left RUNNING); deciding from $me"
    else
        local with=()
        for node in "${CTRAIN_UNANSWERED[@]}"; do
            echo "$node" >>"$dir/lost"
            [[ $node == "$batch" ]] || with+=("$node")
        done
        if ((${#with[@]} == 0)); then
            CTRAIN_LOST_WHY="the batch host: $why and its slurmd does not answer; seen from $me"
        else
            CTRAIN_LOST_WHY="the batch host and ${with[*]}: $why and their slurmds do not answer; seen from $me"
        fi
        # What is left of the training step goes at once (SIGKILL): a rank waiting on the lost node in
        # a collective would otherwise outlive the decision by up to KillWait seconds, or longer.
        ctrain_kill_step
    fi
    ctrain_decide "$dir" 137 batch-gone
    # No batch script is left to clear the run's files; a requeued run clears them as it starts.
    [[ $(ctrain_state) != ended ]] || rm -rf "${dir:?}"
}

# ctrain_stop PID: end a background srun (TERM, then KILL after 2 s: with a node gone, srun may wait).
ctrain_stop() {
    kill "$1" 2>/dev/null || return 0
    local waited=0
    while kill -0 "$1" 2>/dev/null && ((waited++ < 20)); do sleep 0.1; done
    kill -KILL "$1" 2>/dev/null
    wait "$1" 2>/dev/null
}

# End the training step now: SIGKILL to every process of it on the nodes that still answer, then to
# srun, which would otherwise wait for the tasks of a node that does not.
# scancel is not waited for: with a node gone it can take slurmctld's MessageTimeout to return.
ctrain_end_step() {
    ctrain_kill_step
    sleep 2
    kill -KILL "$CTRAIN_STEP_PID" 2>/dev/null
}

# ctrain_kill_step: SIGKILL, in the background, every process of the training step (its id is in
# CTRAIN_PIDS/step) on the nodes that still answer.
ctrain_kill_step() {
    local step
    if step=$(cat "$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS/step" 2>/dev/null); then
        timeout --signal=KILL 30 scancel --signal=KILL "$SLURM_JOB_ID.$step" 2>/dev/null &
    fi
}

# ctrain_watchdog (in the background, beside the step): watch the ranks' progress from outside.
# Every rank rewrites CTRAIN_HEARTBEATS/rank-R ("STEP HOST PID") when it finishes a step, an eval
# batch or a save. A stopped rank, or one stuck in a collective, cannot report itself, and the
# collective timeout of torch.distributed is 30 minutes. The watchdog arms at the first heartbeat
# (start-up, model loading and the first compile are not counted) and, once any rank has gone
# CTRAIN_HANG_TIMEOUT seconds without one, names the ranks, shows their processes' states and
# ends the step as a lost rank ends it: the workers are killed, the launchers and srun follow.
# A rank whose run is over writes "done" there and is no longer expected to step (rank 0 may
# still be evaluating the final model, beating per batch).
# A node that goes silent without closing its connections (frozen, cut off the network) fails no
# launcher: every rank just waits in its collective. So in a job of several nodes, once a rank has
# gone CTRAIN_NODE_CHECK seconds without a heartbeat, and again every CTRAIN_NODE_CHECK seconds while
# that lasts, every node is asked whether its slurmd answers (ctrain_silent).
ctrain_watchdog() {
    local dir=$CTRAIN_PROJECT_DIR/$CTRAIN_HEARTBEATS budget=$CTRAIN_HANG_TIMEOUT check=$CTRAIN_NODE_CHECK
    local world=$((CTRAIN_NNODES * CTRAIN_NPROC_PER_NODE)) poll=$((CTRAIN_HANG_TIMEOUT / 10))
    ((CTRAIN_NNODES > 1)) || check=0
    ((budget > 0)) || poll=30
    ((check == 0 || poll <= check / 10)) || poll=$((check / 10))
    ((poll >= 1)) || poll=1
    ((poll <= 30)) || poll=30
    local -A seen since
    local -A finished
    local armed= file rank stamp now idle quiet asked=0 stale=() first
    while ((${#stale[@]} == 0)); do
        sleep "$poll"
        now=$SECONDS
        for file in "$dir"/rank-*; do
            rank=${file##*/rank-}
            stamp=$(stat -c %.9Y "$file" 2>/dev/null) || continue
            [[ ${seen[$rank]-} == "$stamp" ]] || { seen[$rank]=$stamp; since[$rank]=$now; }
            : "${armed:=$now}"
            read -r first _ <"$file" 2>/dev/null && [[ $first == done ]] && finished[$rank]=1
        done
        [[ -n $armed ]] || continue
        quiet=0
        for ((rank = 0; rank < world; rank++)); do
            [[ -z ${finished[$rank]-} ]] || continue # its run is over (rank 0 may still evaluate)
            idle=$((now - ${since[$rank]:-$armed}))
            ((idle <= quiet)) || quiet=$idle
            ((budget == 0 || idle <= budget)) || stale+=("$rank:$idle")
        done
        if ((${#stale[@]} == 0 && check > 0 && quiet >= check && now - asked >= check)); then
            asked=$now
            ctrain_silent "$quiet" && return 0
        fi
    done
    ctrain_hung "$dir" "${stale[@]}"
}

# ctrain_silent SECONDS: ask every node of the job whether its slurmd answers (ctrain_probe), after
# SECONDS without a finished step on some rank; when one does not, it is lost (CTRAIN_PIDS/lost) and
# the step is ended. Fails (nothing done) when every node answers: a long step, evaluation or save.
# A probe needs the controller too, so a controller that is restarting or too slow makes healthy
# nodes look silent: the silent ones are asked a second time, and the controller before and after;
# a healthy run is not ended for the controller's sake.
ctrain_silent() {
    local nodes=()
    ctrain_job_is RUNNING || return 1
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    ctrain_probe "${nodes[@]}"
    ((${#CTRAIN_UNANSWERED[@]} > 0)) || return 1
    nodes=("${CTRAIN_UNANSWERED[@]}")
    ctrain_probe "${nodes[@]}"
    ((${#CTRAIN_UNANSWERED[@]} > 0)) && ctrain_job_is RUNNING || return 1
    echo "ctrain: no finished step for ${1}s, and ${CTRAIN_UNANSWERED[*]} does not answer, asked twice (frozen, or" \
        "cut off the network): ending the step"
    echo "${CTRAIN_UNANSWERED[*]}" >"$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS/lost"
    ctrain_transition ending
    ctrain_end_step
}

# ctrain_hung DIR RANK:IDLE...: report the ranks without progress, with the state of each worker
# process (T: stopped, D: uninterruptible, in the kernel or a driver; S or R: alive, e.g. waiting
# in a collective for a rank that is not), then end the step.
ctrain_hung() {
    local dir=$1 entry rank idle step host pid stat
    shift
    echo "ctrain: hang: no finished step for more than CTRAIN_HANG_TIMEOUT=${CTRAIN_HANG_TIMEOUT}s on $# rank(s); ending the step"
    local -A state
    while read -r host pid stat; do
        state[$host $pid]=$stat
    done < <(ctrain_on_nodes 'ps -o pid=,stat= --ppid "$(cat "$1/$(uname -n).pid")" | sed "s/^ */$(uname -n) /"' \
        "$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS")
    local culprits=()
    for entry in "$@"; do
        rank=${entry%%:*} idle=${entry#*:} step=- host=? pid=?
        [[ ! -r $dir/rank-$rank ]] || read -r step host pid <"$dir/rank-$rank"
        echo "ctrain: hang: rank $rank on $host (pid $pid): last step $step, no progress for ${idle}s," \
            "process state ${state[$host $pid]:-gone}"
        [[ ${state[$host $pid]:-gone} != [TDZ]* && -n ${state[$host $pid]-} ]] || culprits+=("rank $rank on $host")
    done
    if ((${#culprits[@]} > 0)); then
        echo "ctrain: hang: not running (stopped, stuck in the kernel, or gone): $(IFS=,; echo "${culprits[*]}")"
    else
        echo "ctrain: hang: every rank is alive but none finishes a step: a collective that some rank never joined?"
    fi
    echo "$*" >"$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS/hung"
    ctrain_transition ending
    ctrain_on_nodes 'pkill -KILL -P "$(cat "$1/$(uname -n).pid")"' "$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS"
}

# Hand a signal to the training workers (the launcher's children) on every node, through a
# short step beside the training step. Not through the step itself: Slurm would signal every
# process in it, the launcher (which forwards only TERM, INT, HUP, QUIT) and Apptainer's
# squashfuse, whose end takes the image's files away from the workers mid-checkpoint.
# A command of your own that has not opted in (no heartbeat from any rank: docs/sbatch.md) cannot
# checkpoint at the warning and would run into the time limit, after which Slurm requeues nothing:
# the job is requeued now, and the next run starts from the script's own last checkpoint.
ctrain_forward() {
    CTRAIN_SIGNAL=$1
    ctrain_transition warned
    echo "ctrain: SIG$1 (time limit near): passing it to the training processes on every node"
    ctrain_on_nodes 'pkill -"$2" -P "$(cat "$1/$(uname -n).pid")"' "$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS" "$1"
    if ((${#CTRAIN_COMMAND[@]} > 0)) && ! compgen -G "$CTRAIN_PROJECT_DIR/$CTRAIN_HEARTBEATS/rank-*" >/dev/null; then
        echo "ctrain: your command has not opted in to checkpoint at the signal (no heartbeat from it); the job" \
            "is requeued now and its next run starts from the script's own last checkpoint"
        ctrain_requeue_if_asked "$CTRAIN_REQUEUE_EXIT"
    fi
}

# --- image cache (Apptainer) ---------------------------------------------------------------------
#
# An image file is unpacked once per node, into CTRAIN_IMAGE_CACHE/KEY/rootfs, and every later job
# and requeue on that node runs that directory: no squashfuse process for Slurm's TERM to end, and no
# unpacking or deleting of GBs at each start and end. One entry (docs/sbatch.md lists the files):
#   rootfs/    the unpacked image          image     the file it came from
#   complete   written last: an entry without it is half-unpacked, never run, and removed
#   used       touched at each job's start (least recently used entries are evicted first)
#   size-kib   the unpacked size
# `lock` (the cache's) lets one job at a time unpack or evict on a node; each running task holds a
# shared lock on its entry's `complete` (CTRAIN_IMAGE_HOLD), and an entry so held is never evicted.
# `ctrain cache` lists and clears the entries of the node it runs on.

# ctrain_image_key IMAGE: the image's cache key: its size and first 64 KiB (a SIF's header holds the
# unique ID and modification time its build gave it), hashed. It reads 64 KiB, not the whole image,
# from the shared filesystem; "unread" when the file cannot be read (dry runs).
ctrain_image_key() {
    local size
    size=$(stat -L -c %s "$1" 2>/dev/null) && [[ -r $1 ]] || { echo unread; return; }
    { echo "$size"; head -c 65536 "$1"; } | sha256sum | cut -c1-16
}

# On each node (ctrain_on_nodes): $1 cache, $2 image, $3 key, $4 size limit in GiB. Unpacks the
# image unless complete, marks it used, then evicts the least recently used entries that no task
# holds and that no job started in the last 10 minutes, until the cache fits the limit.
CTRAIN_IMAGE_PREPARE='cache=$1 image=$2 key=$3 limit_kib=$(($4 * 1048576)) node=$(uname -n)
remove() { chmod -R u+rwX "$1" 2>/dev/null; rm -rf "$1"; } # unpacked images have read-only directories
umask 077
mkdir -p "$cache" && exec 8>>"$cache/lock" && flock 8 || exit 1
entry=$cache/$key
if [ -e "$entry/complete" ]; then
    echo "ctrain: $node: the image is cached in $entry"
else
    remove "$entry"
    mkdir "$entry" || exit 1
    start=$(date +%s)
    apptainer=apptainer
    command -v apptainer >/dev/null || apptainer=singularity
    if ! "$apptainer" build --force --sandbox "$entry/rootfs" "$image" >"$entry/unpack.log" 2>&1; then
        echo "ctrain: $node: could not unpack $image into $entry: $(tail -n 3 "$entry/unpack.log")" >&2
        remove "$entry"
        exit 1
    fi
    du -sk "$entry/rootfs" | cut -f1 >"$entry/size-kib"
    printf "%s\n" "$image" >"$entry/image"
    rm -f "$entry/unpack.log"
    : >"$entry/complete"
    echo "ctrain: $node: unpacked $image into $entry in $(($(date +%s) - start)) s (kept for later jobs)"
fi
touch "$entry/used"
total=0
for dir in "$cache"/*/; do
    dir=${dir%/}
    [ -d "$dir" ] || continue
    [ -e "$dir/complete" ] || { [ "$dir" = "$entry" ] || remove "$dir"; continue; }
    total=$((total + $(cat "$dir/size-kib" 2>/dev/null || echo 0)))
done
[ "$total" -gt "$limit_kib" ] || exit 0
ls -1dtr "$cache"/*/used | while IFS= read -r used; do
    dir=${used%/used}
    [ "$total" -gt "$limit_kib" ] || break
    [ "$dir" != "$entry" ] && [ -z "$(find "$used" -mmin -10)" ] || continue
    size=$(cat "$dir/size-kib" 2>/dev/null || echo 0) name=$(cat "$dir/image" 2>/dev/null)
    if flock -n -x "$dir/complete" sh -c "chmod -R u+rwX \"\$0\" 2>/dev/null; rm -rf \"\$0\"" "$dir"; then
        total=$((total - size))
        echo "ctrain: $node: evicted $name ($((size / 1024)) MiB) from the image cache"
    fi
done'

# What each srun task runs before Apptainer ($1 the entry, then Apptainer's words): a shared lock on
# the entry for as long as the container runs (the descriptor passes to Apptainer through exec), so
# that no other job evicts it; an entry evicted while this job started is named, not run.
CTRAIN_IMAGE_HOLD='[ -e "$1/complete" ] && command exec 9<"$1/complete" && flock -s 9 && [ -e "$1/complete" ] || {
    echo "ctrain: $(uname -n): the cached image $1 is gone (removed while the job started); submit again" >&2
    exit 1
}
shift
exec "$@"'

# ctrain_image_cache: the image unpacked and current in the cache of every node of the job.
ctrain_image_cache() {
    ctrain_on_nodes "$CTRAIN_IMAGE_PREPARE" "$CTRAIN_IMAGE_CACHE" "$CTRAIN_IMAGE" \
        "${CTRAIN_IMAGE_ENTRY##*/}" "$CTRAIN_IMAGE_CACHE_GB" ||
        ctrain_die "the image could not be made ready on every node (above); CTRAIN_IMAGE_CACHE=$CTRAIN_IMAGE_CACHE" \
            "must be on node-local disk with room for the unpacked image"
}

# ctrain_on_nodes SCRIPT ARG...: run `sh -c SCRIPT` once on every node of the step, on the host,
# beside the training step (the launcher's PID is in ARG1/NODE.pid). Given up after two minutes:
# a node that does not answer must not hold the batch shell.
ctrain_on_nodes() {
    local script=$1
    shift
    timeout 120 srun --overlap --nodes="$CTRAIN_NNODES" --ntasks="$CTRAIN_NNODES" --ntasks-per-node=1 \
        sh -c "$script" ctrain-on-node "$@"
}

# The run asked to come back: it was warned of the time limit, or the trainer exited with its
# requeue code after saving a checkpoint. The requeued job resumes from that checkpoint.
ctrain_requeue_if_asked() {
    local rc=$1 restarts=${SLURM_RESTART_COUNT:-0}
    if [[ $CTRAIN_SIGNAL == TERM ]]; then
        # Slurm itself requeues a job it preempted or was told to requeue; scancel means stop.
        echo "ctrain: SIGTERM came from Slurm (scancel, scontrol requeue or preemption): Slurm decides whether the job runs again"
        return 0
    fi
    [[ $CTRAIN_SIGNAL == USR1 || $rc -eq $CTRAIN_REQUEUE_EXIT ]] || return 0
    if ((restarts >= CTRAIN_MAX_REQUEUES)); then
        echo "ctrain: not requeueing: already restarted $restarts times (CTRAIN_MAX_REQUEUES=$CTRAIN_MAX_REQUEUES)"
        return 0
    fi
    echo "ctrain: requeueing job $SLURM_JOB_ID (restart $((restarts + 1))); it resumes from the last checkpoint"
    ctrain_requeue
}

# ctrain_requeue [EXCLUDED]: requeue the job (once Slurm has requeued it, as after a node failure, only
# its excluded nodes change), with EXCLUDED as its ExcNodeList; sets CTRAIN_REQUEUED. A requeue TERMs
# this shell, which from here on ignores TERM, so that the decision is recorded (the run's state and
# the timeline) whenever Slurm's TERM arrives; Slurm's SIGKILL comes KillWait seconds later. (The
# TERM used to be caught again right after the requeue, and a TERM that came late killed the shell
# before it recorded the decision: seen in a chaos soak.) Only a pending job's ExcNodeList can
# change, so it is set after the requeue.
ctrain_requeue() {
    trap '' TERM
    if ctrain_job_is PENDING || scontrol requeue "$SLURM_JOB_ID"; then
        if [[ -z ${1-} ]] || scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$1"; then
            CTRAIN_REQUEUED=1
        fi
    fi
}

# ctrain_retry_once: a rank failed or hung on a node that is still up (killed by the kernel for
# memory, a transient device or network fault, or a bug in the training code, which fails the same
# way again): requeue once per job, within CTRAIN_MAX_REQUEUES; the next run resumes from the last checkpoint.
ctrain_retry_once() {
    local restarts=${SLURM_RESTART_COUNT:-0} marker=$CTRAIN_PROJECT_DIR/.ctrain/$SLURM_JOB_ID.retried
    if [[ -e $marker ]]; then
        echo "ctrain: not requeueing: the job was already retried once after a failed or hung rank; the failure" \
            "above repeats, so it is likely in the training code or the data"
    elif ((restarts >= CTRAIN_MAX_REQUEUES)); then
        echo "ctrain: not requeueing: already restarted $restarts times (CTRAIN_MAX_REQUEUES=$CTRAIN_MAX_REQUEUES)"
    else
        : >"$marker"
        echo "ctrain: requeueing job $SLURM_JOB_ID once (restart $((restarts + 1))); it resumes from the last checkpoint"
        ctrain_requeue
    fi
}

# ctrain_requeue_without NODE...: requeue the job with the lost nodes excluded, where the partition
# still has enough nodes in service without them (and without those excluded before); otherwise
# end, naming the nodes. Requeued as it was, the job would wait for them: PENDING, with no end, on
# nodes that are DOWN.
ctrain_requeue_without() {
    local restarts=${SLURM_RESTART_COUNT:-0} excluded before usable=0 node state
    before=$(scontrol show job -o "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*')
    before=${before#ExcNodeList=}
    [[ $before != "(null)" ]] || before=
    excluded=$({ [[ -z $before ]] || scontrol show hostnames "$before"; printf '%s\n' "$@"; } | sort -u | paste -sd,)
    excluded=$(scontrol show hostlist "$excluded")
    while read -r node state; do
        [[ $state =~ ^(idle|mix|mixed|alloc|allocated|comp|completing)$ ]] || continue
        scontrol show hostnames "$excluded" | grep -qx "$node" || usable=$((usable + 1))
    done < <(sinfo -h -N -p "${SLURM_JOB_PARTITION:-}" -o '%N %t' | sort -u)
    if ((restarts >= CTRAIN_MAX_REQUEUES)); then
        echo "ctrain: not requeueing: already restarted $restarts times (CTRAIN_MAX_REQUEUES=$CTRAIN_MAX_REQUEUES)"
    elif ((usable < CTRAIN_NNODES)); then
        echo "ctrain: not requeueing: partition ${SLURM_JOB_PARTITION:-} has $usable node(s) in service besides" \
            "$excluded, the job needs $CTRAIN_NNODES; submit it again once $* is back (sinfo -n $*)," \
            "or on fewer nodes; it resumes from the last checkpoint"
    else
        echo "ctrain: requeueing job $SLURM_JOB_ID (restart $((restarts + 1))) without $excluded" \
            "(ExcNodeList); it resumes from the last checkpoint once Slurm has let go of the lost node"
        ctrain_requeue "$excluded"
        [[ -n $CTRAIN_REQUEUED ]] || echo "ctrain: requeueing without $excluded failed (above)"
    fi
}

# --- helpers --------------------------------------------------------------------------------------

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

ctrain_summary() {
    echo "ctrain: job ${SLURM_JOB_ID} '${SLURM_JOB_NAME:-}' restart ${SLURM_RESTART_COUNT:-0}" \
        "on $CTRAIN_NNODES node(s) [${SLURM_JOB_NODELIST}] x $CTRAIN_NPROC_PER_NODE process(es)"
    if ((${#CTRAIN_COMMAND[@]} > 0)); then
        echo "ctrain: $CTRAIN_RUNTIME image $CTRAIN_IMAGE, $CTRAIN_LAUNCHER, your command: ${CTRAIN_COMMAND[*]}" \
            "(rendezvous $CTRAIN_MASTER_ADDR:$CTRAIN_MASTER_PORT)"
        echo "ctrain: it runs in $CTRAIN_WORKDIR, which is the project directory $CTRAIN_PROJECT_DIR on every node;" \
            "write outputs under /outputs ($CTRAIN_OUTPUTS)${CTRAIN_DATA:+; data: /data ($CTRAIN_DATA)}"
        return
    fi
    echo "ctrain: $CTRAIN_RUNTIME image $CTRAIN_IMAGE, $CTRAIN_LAUNCHER, recipe $CTRAIN_RECIPE" \
        "${CTRAIN_OVERRIDES[*]:+${CTRAIN_OVERRIDES[*]} }(rendezvous $CTRAIN_MASTER_ADDR:$CTRAIN_MASTER_PORT)"
}

# ctrain_main RUNTIME [RECIPE] [KEY=VALUE ...] | RUNTIME -- COMMAND [ARG ...]: the whole job.
ctrain_main() {
    ctrain_settings "$@"
    ctrain_allocation
    ctrain_environment
    ctrain_container
    ctrain_launcher
    ctrain_summary
    ctrain_run
}
