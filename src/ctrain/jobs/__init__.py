"""Slurm jobs: ``ctrain submit`` (:mod:`ctrain.jobs.submit`: render an ``sbatch/`` script with the
project's settings, check it, queue it) and the commands that follow a job (``status``, ``logs``,
``cancel``, in :mod:`ctrain.jobs.cli`, over :mod:`ctrain.slurm`)."""
