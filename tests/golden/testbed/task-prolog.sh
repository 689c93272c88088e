#!/bin/sh
# Written by `ctrain testbed up`; rewritten on every start. See docs/testbed.md (GPUs).
# Slurm's TaskProlog: what it prints as `export NAME=VALUE` is set in the task's environment.
# A node with a scratch disk of its own (a directory named after it, made by the tests) gets it as
# TMPDIR, as a node-local /tmp.
[ -z "${SLURMD_NODENAME:-}" ] || [ ! -d /var/lib/ctrain/testbed/scratch/"$SLURMD_NODENAME" ] ||
    echo "export TMPDIR="/var/lib/ctrain/testbed/scratch/"$SLURMD_NODENAME"
# The testbed's nodes share this machine's GPUs. Slurm numbers each node's GPUs from 0, as on a real
# node; here they are turned into this machine's own GPUs (UUIDs, else device numbers), so that
# CUDA on node2 uses node2's GPU and not the machine's first one.
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] || exit 0
case ${SLURMD_NODENAME:-} in
    node1) gpus='GPU-1f6b0c8e-0000-4000-8000-000000000000' ;;
    node2) gpus='GPU-9a4d2e71-0000-4000-8000-000000000001' ;;
    *) exit 0 ;;
esac
# nth N WORD...: the Nth word, counting from 0
nth() {
    shift "$(($1 + 1))"
    echo "$1"
}
count=$(echo $gpus | wc -w)
out=
for index in $(echo "$CUDA_VISIBLE_DEVICES" | tr ',' ' '); do
    case $index in
        '' | *[!0-9]*) exit 0 ;; # not a number: leave the value as Slurm set it
    esac
    [ "$index" -lt "$count" ] || exit 0
    out=${out:+$out,}$(nth "$index" $gpus)
done
echo "export CUDA_VISIBLE_DEVICES=$out"
