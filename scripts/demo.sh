#!/usr/bin/env bash
# The quickstart's main job, as root on a machine set up by scripts/setup.sh: build the CPU
# training image, convert it to SIF, start the Slurm testbed, train the demo recipe on 2 nodes x 2
# processes inside the container, and print the trained model's accuracy.
#
# The testbed is a cluster like any other: the project directory lives on its shared filesystem,
# the job runs as the testbed's unprivileged user, and `ctrain submit` checks and writes the job
# script that the user then queues with sbatch.
set -euo pipefail
cd "$(dirname "$0")/.."
ctrain() { .venv/bin/ctrain "$@"; }

step() { printf '\n== %s\n' "$*" >&2; }

step "build the CPU training image (Debian base made here, no registry needed)"
ctrain build --flavour cpu --local-base

step "start the Slurm testbed: 2 nodes"
ctrain testbed up --nodes 2
shared=$(ctrain testbed status --shared-dir)
project=$shared/demo
user=$(stat -c %U "$shared")

step "a project directory on the cluster's shared filesystem: $project"
mkdir -p "$project/logs" "$project/images"
cp -r sbatch recipes "$project/"
[[ ! -d configs ]] || cp -r configs "$project/"
cat >"$project/ctrain.yaml" <<'EOF'
# The demo on the testbed: 2 CPU-only nodes, 2 training processes on each.
slurm:
  runtime: apptainer
  nodes: 2
  ntasks_per_node: 2
  time: "00:30:00"
  image: images/ctrain-latest.sif
EOF

step "convert the image to SIF, into the project"
ctrain convert --to sif --output "$project/images/ctrain-latest.sif"
chown -R "$user:" "$project"

step "check the job and write its script (ctrain submit), then queue it as $user"
(cd "$project" && ctrain submit --write-script logs/demo.sbatch recipes/demo-addition.yaml)
job=$(ctrain testbed exec -- sh -c "cd '$project' && sbatch --parsable logs/demo.sbatch" | tail -n 1)
job=${job%%;*}

step "job $job: following its log"
(cd "$project" && ctrain logs --follow "$job")
ctrain status "$job"
state=$(ctrain status "$job" | awk -v id="$job" '$1 == id { print $3 }')
if [[ $state != COMPLETED ]]; then
    echo "demo job $job ended $state; its log: $project/logs/ctrain-$job.out" >&2
    exit 1
fi

step "accuracy of the trained model on held-out problems"
(cd "$project" && ctrain eval recipes/demo-addition.yaml --model outputs/demo-addition/final)
