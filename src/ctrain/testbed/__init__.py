"""``ctrain testbed``: a real multi-node Slurm + Apptainer cluster on one machine.

A bridge and one network namespace per node give each node its own hostname and IP; munged,
slurmctld and one slurmd per node run as real daemons; jobs run as an unprivileged user and
share the host's filesystem. See docs/testbed.md.
"""

from ctrain.testbed.control import NodeStatus, Status, Testbed, usage
from ctrain.testbed.demo import build_demo_image
from ctrain.testbed.plan import DEFAULT_STATE_DIR, JOB_USER, STATE_DIR_ENV, Node

__all__ = [
    "DEFAULT_STATE_DIR",
    "JOB_USER",
    "STATE_DIR_ENV",
    "Node",
    "NodeStatus",
    "Status",
    "Testbed",
    "build_demo_image",
    "usage",
]
