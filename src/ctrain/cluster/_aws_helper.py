"""The two AWS steps ctrain takes itself, with the boto3 that ParallelCluster brings.

Usage:
  python _aws_helper.py credentials
      Which credentials the AWS SDK would use, found locally without calling AWS.
      Prints {"found": true|false, "method": "...", "error": "..."}.
  python _aws_helper.py upload BUCKET KEY=FILE [KEY=FILE ...]
      Uploads custom-action scripts. Prints {"uploaded": ["s3://BUCKET/KEY", ...]} or {"error": "..."}.

``ctrain cluster`` runs this with the Python that has aws-parallelcluster (and so boto3) installed, as
a separate process, so ctrain needs neither in its own environment. Imports boto3, never ctrain.
"""

from __future__ import annotations

import json
import sys


def credentials() -> dict[str, object]:
    import botocore.exceptions
    import botocore.session

    try:
        found = botocore.session.get_session().get_credentials()
    except botocore.exceptions.BotoCoreError as exc:
        return {"found": False, "method": None, "error": str(exc)}
    return {"found": found is not None, "method": getattr(found, "method", None), "error": None}


def upload(bucket: str, pairs: list[str]) -> dict[str, object]:
    import boto3
    import botocore.exceptions

    client = boto3.client("s3")
    done = []
    try:
        for pair in pairs:
            key, _, path = pair.partition("=")
            client.upload_file(path, bucket, key)
            done.append(f"s3://{bucket}/{key}")
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as exc:
        return {"uploaded": done, "error": str(exc)}
    return {"uploaded": done, "error": None}


def main(argv: list[str]) -> int:
    if argv[1:2] == ["credentials"]:
        reply = credentials()
    elif argv[1:2] == ["upload"] and len(argv) > 3:
        reply = upload(argv[2], argv[3:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(reply))
    return 0 if not reply.get("error") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
