"""Check a ParallelCluster config against ParallelCluster's own ClusterSchema, offline.

Usage: python _schema_check.py CONFIG.yaml CLUSTER_NAME REGION

``ctrain cluster validate`` runs this with the Python that has aws-parallelcluster installed, as a
separate process, because loading the schema needs a region and some credentials to exist: dummy
ones are set here, in this process only, so they never reach ctrain or a real AWS call. Any AWS call
would go to a closed local port and fail at once. It imports ParallelCluster, never ctrain.

Prints one JSON object: {"version": "<pcluster version>", "errors": <marshmallow messages or null>}.
"""

from __future__ import annotations

import json
import os
import sys

_OFFLINE = {
    "AWS_ACCESS_KEY_ID": "offline-schema-check",
    "AWS_SECRET_ACCESS_KEY": "offline-schema-check",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
}
_DROP = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ROLE_ARN")


def main(argv: list[str]) -> int:
    path, name, region = argv[1:4]
    for key in _DROP:
        os.environ.pop(key, None)
    os.environ.update(_OFFLINE, AWS_DEFAULT_REGION=region)

    from marshmallow import ValidationError
    from pcluster.models.common import parse_config
    from pcluster.schemas.cluster_schema import ClusterSchema
    from pcluster.utils import get_installed_version

    errors: object = None
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        ClusterSchema(cluster_name=name).load(parse_config(text))
    except ValidationError as exc:
        errors = exc.messages
    except Exception as exc:  # pcluster turns any load failure into "Invalid cluster configuration: ..." too
        errors = {"_schema": [f"{type(exc).__name__}: {exc}"]}
    print(json.dumps({"version": get_installed_version(), "errors": errors}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
