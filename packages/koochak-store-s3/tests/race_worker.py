"""One racer of test_races.py: reads "<round> <start_time>" lines, races at that moment.

argv: endpoint bucket prefix worker_id op size. op "put" puts key race/<round>; op "publish"
publishes race/step<round>.bin with its ready manifest. Prints "<round> won", "<round> lost"
(FileExistsError) or "<round> error <text>" per round. Credentials come from the environment.
"""

from __future__ import annotations

import hashlib
import sys
import time

from koochak.s3 import S3Config, S3Store
from koochak.storage.artifact import publish


def payload(worker: int, round_: int, size: int) -> bytes:
    seed = hashlib.sha256(f"{worker}:{round_}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def main() -> None:
    endpoint, bucket, prefix, worker, op, size = sys.argv[1:7]
    config = S3Config(bucket=bucket, prefix=prefix, endpoint=endpoint, region="us-east-1",
                      path_style=True, part_bytes=5 << 20, concurrency=2,
                      verify_commit=True)  # fmt: skip
    store = S3Store(config)
    store._trusts_conditional_writes()  # the endpoint check, before the first race
    print("ready", flush=True)
    for line in sys.stdin:
        round_text, start = line.split()
        round_ = int(round_text)
        data = payload(int(worker), round_, int(size))
        time.sleep(max(0.0, float(start) - time.time()))
        try:
            if op == "put":
                store.put(f"race/{round_}", data)
            else:
                publish(store, f"race/step{round_:06d}.bin", data, latest=False)
            print(f"{round_} won", flush=True)
        except FileExistsError:
            print(f"{round_} lost", flush=True)
        except Exception as exc:  # reported, so the test shows it
            print(f"{round_} error {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)


if __name__ == "__main__":
    main()
