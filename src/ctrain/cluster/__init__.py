"""``ctrain cluster``: an AWS ParallelCluster for training, from template to teardown.

- :mod:`ctrain.cluster.setup`: the ``cluster:`` settings with overrides, shipped files, region.
- :mod:`ctrain.cluster.template`: fills ``cluster/pcluster.yaml`` into a ready config (``init``).
- :mod:`ctrain.cluster.checks`: offline validation with ParallelCluster's own schema and validators,
  plus ctrain's rules.
- :mod:`ctrain.cluster.pcluster`: drives the ``pcluster`` CLI (create, describe, delete, ssh) and
  parses its JSON narrowly (``up``, ``status``, ``ssh``, ``down``, ``validate --aws``).

The ``pcluster`` CLI and its library are the ``aws`` extra. Anything that needs the library runs in
the Python that has it, as a separate process (``_offline_check.py``, ``_aws_helper.py``), so ctrain
itself works whether pcluster shares its virtual environment or lives in its own.
"""
