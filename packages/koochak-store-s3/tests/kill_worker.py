"""test_kill.py's writer: puts a large object from a source that stalls after some parts.

argv: endpoint bucket prefix. Prints "uploading" once two parts have been handed to the put,
then waits to be killed.
"""

from __future__ import annotations

import os
import sys
import time

from koochak.s3 import S3Config, S3Store


def source():
    for _ in range(2):
        yield os.urandom(5 << 20)
    yield os.urandom(5 << 20)
    time.sleep(1.0)  # the pool sends the first parts meanwhile
    print("uploading", flush=True)
    time.sleep(600)
    yield b"never"


endpoint, bucket, prefix = sys.argv[1:4]
config = S3Config(bucket=bucket, prefix=prefix, endpoint=endpoint, region="us-east-1",
                  path_style=True, part_bytes=5 << 20, concurrency=2)  # fmt: skip
S3Store(config).put("victim", source())
