# The job's settings: CTRAIN_* variables, their defaults, their checks; the script's arguments.

# Where the image expects the project: mounted there, and the working directory (containers/Dockerfile).
CTRAIN_WORKDIR=/workspace

# ctrain_settings RUNTIME [RECIPE] [KEY=VALUE ...] | RUNTIME -- COMMAND [ARG ...]: the job's settings,
# defaulted, made absolute and checked, and the script's arguments.
ctrain_settings() {
    CTRAIN_RUNTIME=$1
    shift
    ctrain_defaults
    ctrain_paths
    ctrain_arguments "$@"
    ctrain_sweep_task
    ctrain_check_settings
    ctrain_run_identity
}

# ctrain_defaults: every CTRAIN_* setting the environment (or `ctrain submit`'s settings block) did not
# set, at its default; docs/sbatch.md lists them.
ctrain_defaults() {
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
    : "${CTRAIN_HF_OFFLINE:=1}"                  # 1: the hub offline in the job (its names fetched first: ctrain fetch)
    : "${CTRAIN_REQUEUE_EXIT:=75}"               # the trainer's "checkpointed, requeue me" exit code
    : "${CTRAIN_MAX_REQUEUES:=10}"               # stop requeueing after this many restarts (continuations count)
    : "${CTRAIN_CONTINUE:=1}"                    # 1: a lost node's run continues as a new job at once; 0: requeue
    : "${CTRAIN_HANG_TIMEOUT:=600}"              # seconds without a finished step before a rank counts as hung; 0: off
    : "${CTRAIN_STEP_GRACE:=10}"                 # seconds the other nodes get to end after one node's launcher failed
    : "${CTRAIN_NODE_CHECK:=30}"                 # seconds without a finished step before every node is asked; 0: off
    : "${CTRAIN_APPTAINER_UNSQUASH:=1}"          # 1: run a SIF from a node-local copy (see ctrain_container_apptainer)
    : "${CTRAIN_IMAGE_CACHE:=${APPTAINER_TMPDIR:-${TMPDIR:-/tmp}}/ctrain-images-$(id -u)}" # node-local unpacked images
    : "${CTRAIN_IMAGE_CACHE_GB:=50}"             # the cache's size limit on each node, in GiB
    : "${CTRAIN_PREFLIGHT:=quick}"               # off | quick | full: the checks before the first step (ctrain_preflight)
    : "${CTRAIN_IMAGE_MIN_DRIVER:=}"             # the oldest NVIDIA driver the image runs on (ctrain submit reads it from the image)
    : "${CTRAIN_PREFLIGHT_TMP_MB:=1024}"         # node-local scratch (TMPDIR) a node must have free, in MiB
    : "${CTRAIN_SWEEP:=}"                        # a sweep's table of tasks (ctrain submit --sweep); empty: no sweep
    : "${CTRAIN_DRY_RUN:=0}"                     # 1: print the commands instead of running them
}

# ctrain_paths: files are given relative to the project directory; the containers need absolute paths
# (pyxis reads a relative image path as a registry reference). pyxis takes a registry reference in
# enroot's spelling (nvcr.io#nvidia/pytorch:TAG), users copy Docker's.
ctrain_paths() {
    if ctrain_image_is_file "$CTRAIN_IMAGE"; then
        CTRAIN_IMAGE=$(ctrain_abspath "$CTRAIN_IMAGE")
    elif [[ $CTRAIN_RUNTIME == pyxis ]]; then
        CTRAIN_IMAGE=$(ctrain_enroot_image "$CTRAIN_IMAGE")
    fi
    CTRAIN_HF_CACHE=$(ctrain_abspath "$CTRAIN_HF_CACHE")
    CTRAIN_OUTPUTS=$(ctrain_abspath "$CTRAIN_OUTPUTS")
    [[ -z $CTRAIN_DATA ]] || CTRAIN_DATA=$(ctrain_abspath "$CTRAIN_DATA")
}

# ctrain_arguments [RECIPE] [KEY=VALUE ...] | -- COMMAND [ARG ...]: a recipe first (anything without
# '='), then KEY=VALUE recipe overrides; or `--` and a command of your own (ctrain_launcher says how
# each form starts).
ctrain_arguments() {
    CTRAIN_ARGUMENTS=("$@") # as given, for the run's continuation (ctrain_continue)
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
}

# ctrain_sweep_task: a task of a sweep (CTRAIN_SWEEP, the table `ctrain submit --sweep` wrote, a line
# per task of the job array) takes its line (SLURM_ARRAY_TASK_ID): its arg: words are added to the
# recipe's overrides, or are the command instead; its env: values (CTRAIN_SWEEP_* only) are exported,
# with CTRAIN_SWEEP_NAME and CTRAIN_SWEEP_TASK. The table is data: nothing in it is run as shell text.
ctrain_sweep_task() {
    local table line fields=() field name words=()
    [[ -n $CTRAIN_SWEEP ]] || return 0
    table=$(ctrain_abspath "$CTRAIN_SWEEP")
    [[ ${SLURM_ARRAY_TASK_ID:-} =~ ^[0-9]{1,4}$ ]] ||
        ctrain_die "CTRAIN_SWEEP is set and this job is not a task of a job array (SLURM_ARRAY_TASK_ID is" \
            "'${SLURM_ARRAY_TASK_ID:-}'): submit a sweep with ctrain submit --sweep, or sbatch --array=0-N"
    [[ -f $table && ! -L $table ]] || ctrain_die "the sweep's table $table is not a file (CTRAIN_SWEEP)"
    (($(stat -c %s "$table") <= 1048576)) || ctrain_die "the sweep's table $table is over 1 MiB"
    line=$(sed -n "$((10#$SLURM_ARRAY_TASK_ID + 1)){p;q}" "$table")
    [[ -n $line ]] || ctrain_die "the sweep's table $table has no task $SLURM_ARRAY_TASK_ID"
    IFS=$'\t' read -r -a fields <<<"$line"
    [[ ${fields[0]} =~ ^[A-Za-z0-9._+-]{1,100}$ ]] ||
        ctrain_die "task $SLURM_ARRAY_TASK_ID of $table has no name (its line starts with '${fields[0]}')"
    for field in "${fields[@]:1}"; do
        case $field in
            arg:*) words+=("${field#arg:}") ;;
            env:*=*)
                name=${field#env:}
                name=${name%%=*}
                [[ $name =~ ^CTRAIN_SWEEP_[A-Z0-9_]{1,80}$ && $name != CTRAIN_SWEEP_NAME && $name != CTRAIN_SWEEP_TASK ]] ||
                    ctrain_die "task $SLURM_ARRAY_TASK_ID of $table sets '$name': a sweep sets CTRAIN_SWEEP_* only"
                export "$name=${field#env:"$name"=}"
                ;;
            *) ctrain_die "task $SLURM_ARRAY_TASK_ID of $table has a field that is neither arg: nor env:" ;;
        esac
    done
    if ((${#CTRAIN_COMMAND[@]} > 0)); then
        CTRAIN_COMMAND=("${words[@]}")
    else
        CTRAIN_OVERRIDES+=("${words[@]}")
    fi
    export CTRAIN_SWEEP_NAME=${fields[0]} CTRAIN_SWEEP_TASK=$SLURM_ARRAY_TASK_ID
}

# ctrain_check_settings: the settings that reach the nodes' shell or srun's options, checked.
ctrain_check_settings() {
    # A number: it reaches the nodes' shell arithmetic (CTRAIN_IMAGE_PREPARE).
    [[ $CTRAIN_IMAGE_CACHE_GB =~ ^[0-9]{1,9}$ ]] ||
        ctrain_die "CTRAIN_IMAGE_CACHE_GB is '$CTRAIN_IMAGE_CACHE_GB'; give the image cache's size in GiB (e.g. 50)"
    case $CTRAIN_PREFLIGHT in
        off | quick | full) ;;
        *) ctrain_die "CTRAIN_PREFLIGHT is '$CTRAIN_PREFLIGHT'; valid: off, quick, full" ;;
    esac
    [[ $CTRAIN_IMAGE_MIN_DRIVER =~ ^([0-9]{1,4}(\.[0-9]{1,4}){0,3})?$ ]] ||
        ctrain_die "CTRAIN_IMAGE_MIN_DRIVER is '$CTRAIN_IMAGE_MIN_DRIVER'; give a driver version (e.g. 580.65.06), or leave it empty"
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
