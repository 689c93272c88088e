"""What the batch script and the ranks say to each other, named once.

The sbatch library (bash, ``sbatch/lib/``) supervises each job on the cluster's hosts; the ranks in
the container (``ctrain train``, or a script of your own that opted in: :mod:`ctrain.train.script`)
and the commands on the login node (``ctrain status``, ``ctrain report``) talk with it through
nothing but these: files in the project directory, which every node mounts (:data:`JOB_FILES`,
docs/architecture.md draws the table from it), the environment the library exports to the tasks
(:data:`VARIABLES`), exit codes (:data:`EXIT_CODES`) and the status lines the library prints into
the job's log (:func:`status_events`). Every Python writer and reader of them goes through this
module; ``tests/unit/test_protocol.py`` has Python write each record through it and the real bash
library read it and decide, and the reverse where bash writes.

Words:

- **the run's directory**: ``.ctrain/JOBID/`` in the project (:func:`run_dir_name`), one run's
  shared files, cleared when a run starts and once it is decided. Its variable is
  ``CTRAIN_RUN_DIR``; ``CTRAIN_PIDS`` is the same directory under its name since library version 1
  (when it held only the launchers' PIDs). The library calls it ``CTRAIN_RUN_DIR`` and exports it to
  the tasks and ranks as ``CTRAIN_PIDS`` only (the srun line every job prints is unchanged, and so is
  what older images read); every reader here takes ``CTRAIN_RUN_DIR`` where it is set and else
  ``CTRAIN_PIDS``.
- **the node checks**: what the library runs on each node's host before a run's training step
  (``ctrain_preflight``, its program ``sbatch/lib/programs/node-checks.sh``).
- **the rank checks**: what every rank of ``ctrain train`` runs once its process group is up
  (:mod:`ctrain.train.health`: the driver, GPU memory and rate, an all-reduce).
  The library's lines and ``CTRAIN_PREFLIGHT`` (``off | quick | full``, which sets both) call the
  two together "the preflight"; both write the ``unfit`` file, and a node named there is left out of
  the requeued job.
- **the checks before a run** (:mod:`ctrain.train.preflight`: ``ctrain submit`` and ``ctrain train
  --check`` checking what a recipe points at) are none of the protocol.

Standard library only, importing nothing of ctrain: the trainer, a user's own script and the login
node's commands all import it, and it sits in the foundation (docs/architecture.md).
"""


# The protocol's names, from its parts; ``from ctrain import protocol`` sees them all.
from ctrain.protocol.env import *  # noqa: F403
from ctrain.protocol.files import *  # noqa: F403
from ctrain.protocol.launch import *  # noqa: F403
from ctrain.protocol.records import *  # noqa: F403
from ctrain.protocol.timeline import *  # noqa: F403
