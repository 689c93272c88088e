#!/usr/bin/env bash
# The quickstart's main job, as root on a machine set up by scripts/setup.sh: build the CPU
# training image, convert it to SIF, start the Slurm testbed, train the demo recipe on 2 nodes x 2
# processes inside the container, and print the trained model's accuracy.
#
# The testbed is a cluster like any other: the project directory lives on its shared filesystem
# with one ctrain.yaml for everything (image, conversion, job), the job runs as the testbed's
# unprivileged user, and `ctrain submit` checks the job and writes its script, which that user
# queues with sbatch.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
ctrain() { "$repo/.venv/bin/ctrain" "$@"; }
step() { printf '\n== %s\n' "$*" >&2; }

step "start the Slurm testbed: 2 nodes"
ctrain testbed up --nodes 2
shared=$(ctrain testbed status --shared-dir)
project=$shared/demo
user=$(stat -c %U "$shared")

step "the project directory, on the cluster's shared filesystem: $project"
mkdir -p "$project/logs"
cp -r "$repo/sbatch" "$repo/recipes" "$repo/configs" "$project/"
cat >"$project/ctrain.yaml" <<EOF
# The demo: the CPU flavour of the training image, built here without a registry, and a job of
# 2 CPU-only nodes with 2 training processes each.
image:
  name: ctrain
  tag: demo
  context: $repo
  flavour: cpu
  wheelhouse: $repo/.ctrain/wheels
  torch_index: none
convert:
  output_dir: images
  compression: zstd
slurm:
  runtime: apptainer
  nodes: 2
  ntasks_per_node: 2
  time: "00:30:00"
EOF
cd "$project"

step "build the CPU training image (a Debian base made here; Python packages from a wheelhouse)"
ctrain wheelhouse "$repo/.ctrain/wheels"
ctrain build --local-base

step "convert it to SIF"
ctrain convert --to sif
chown -R "$user:" "$project"

step "check the job and write its script (ctrain submit), then queue it as $user"
ctrain submit --write-script logs/demo.sbatch recipes/demo-addition.yaml
job=$(ctrain testbed exec -- sh -c "cd '$project' && sbatch --parsable logs/demo.sbatch" | tail -n 1)
job=${job%%;*}

step "job $job: its log, until it ends"
ctrain logs --follow "$job"
ctrain status "$job"
state=$(ctrain status "$job" | awk -v id="$job" '$1 == id { print $3 }')
if [[ $state != COMPLETED ]]; then
    echo "demo job $job ended $state; the end of its log, $project/logs/ctrain-$job.out:" >&2
    tail -n 40 "$project/logs/ctrain-$job.out" >&2 || true
    exit 1
fi

step "accuracy of the trained model on held-out problems"
ctrain eval recipes/demo-addition.yaml --model outputs/demo-addition/final --min-accuracy 0.9
