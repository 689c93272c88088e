"""python -m ctrain.protocol: the table of the job's files that docs/architecture.md holds."""

from ctrain.protocol.files import job_files_table

print(job_files_table(), end="")
