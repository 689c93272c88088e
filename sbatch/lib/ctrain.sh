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
# Each step lives in a file of its own beside this one, by concern (README.md has the map).
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
#   version 6: the library in files by concern (sbatch/lib/*.sh, the nodes' programs in programs/),
#              assembled by ctrain submit; the decision made from facts by one pure classifier; the
#              sentinel ships every function it calls, found, not listed; the deepspeed launcher's
#              config is a default (training.deepspeed?=FILE) that a recipe's own config overrides;
#              the hub offline in the job (CTRAIN_HF_OFFLINE)
#   version 7: a lost node's run continues at once as a new job on the healthy nodes (CTRAIN_CONTINUE),
#              instead of a requeue that waits minutes for Slurm to let go of the node; one run across
#              its job ids (CTRAIN_RUN, .ctrain/RUN.holder, .ctrain/RUN.timeline)
#   version 8: a sweep's tasks, one job array: each task takes its values from the table ctrain submit
#              wrote (CTRAIN_SWEEP, SLURM_ARRAY_TASK_ID), and goes on after a lost node as a one-task
#              array of its own index
CTRAIN_LIB_VERSION=8

# The library's files, beside this one, in the order they are sourced. `ctrain submit` inlines each
# in place of its line (ctrain.jobs.library.assemble), and each program the nodes run in place of its
# ctrain_program line, so a submitted job reads none of these files. README.md explains the parts.
CTRAIN_LIB_DIR=${BASH_SOURCE[0]%/*}
[[ $CTRAIN_LIB_DIR != "${BASH_SOURCE[0]}" ]] || CTRAIN_LIB_DIR=.

# ctrain_program NAME FILE: NAME holds the program in programs/FILE, without the comment lines it
# starts with (what it is, for its readers); FILE `-`: the program on stdin, where ctrain submit
# inlined it as a here-document.
ctrain_program() {
    local text
    if [[ $2 == - ]]; then
        text=$(cat)
    else
        text=$(<"$CTRAIN_LIB_DIR/programs/$2") || exit 2
    fi
    while [[ $text == "#"* ]]; do
        text=${text#*$'\n'}
    done
    printf -v "$1" %s "$text"
}

source "$CTRAIN_LIB_DIR/settings.sh" || exit 2
source "$CTRAIN_LIB_DIR/launch.sh" || exit 2
source "$CTRAIN_LIB_DIR/run.sh" || exit 2
source "$CTRAIN_LIB_DIR/preflight.sh" || exit 2
source "$CTRAIN_LIB_DIR/life.sh" || exit 2
source "$CTRAIN_LIB_DIR/probe.sh" || exit 2
source "$CTRAIN_LIB_DIR/facts.sh" || exit 2
source "$CTRAIN_LIB_DIR/decide.sh" || exit 2
source "$CTRAIN_LIB_DIR/requeue.sh" || exit 2
source "$CTRAIN_LIB_DIR/chain.sh" || exit 2
source "$CTRAIN_LIB_DIR/watch.sh" || exit 2
source "$CTRAIN_LIB_DIR/sentinel.sh" || exit 2
source "$CTRAIN_LIB_DIR/image.sh" || exit 2
source "$CTRAIN_LIB_DIR/util.sh" || exit 2
