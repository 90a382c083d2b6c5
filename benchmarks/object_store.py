"""Which object-store library moves a job's files fastest: fsspec's s3fs or obstore, uploading and
downloading one object of --mb MiB against an S3-compatible server on this machine (moto's server
mode, started here), in bounded memory both ways (--chunk-mib writes and reads, --part-mib parts).

Each library runs --repeats times; prints one JSON line per library and direction (best and median
MiB/s). The server holds the object in its own memory, so the figures are the client's and the
server's CPU on this machine, not a network's.

  python benchmarks/object_store.py --mb 200 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}


@contextmanager
def moto_server() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def s3fs_pair(endpoint: str, part: int) -> tuple[Callable[..., None], Callable[..., int]]:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, default_block_size=part)
    fs.mkdir("bench")

    def upload(key: str, chunks: Iterator[bytes]) -> None:
        with fs.open(f"bench/{key}", "wb", block_size=part) as f:
            for chunk in chunks:
                f.write(chunk)

    def download(key: str, chunk: int) -> int:
        total = 0
        with fs.open(f"bench/{key}", "rb", block_size=part) as f:
            while data := f.read(chunk):
                total += len(data)
        return total

    return upload, download


def obstore_pair(endpoint: str, part: int) -> tuple[Callable[..., None], Callable[..., int]]:
    import obstore
    from obstore.store import S3Store

    store = S3Store("bench-obstore", endpoint=endpoint, allow_http=True, region="us-east-1")
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench-obstore")

    def upload(key: str, chunks: Iterator[bytes]) -> None:
        with obstore.open_writer(store, key, buffer_size=part) as f:
            for chunk in chunks:
                f.write(chunk)

    def download(key: str, chunk: int) -> int:
        total = 0
        for data in obstore.get(store, key).stream(min_chunk_size=chunk):
            total += len(data)
        return total

    return upload, download


def _chunks(total: int, chunk: int) -> Iterator[bytes]:
    block = os.urandom(chunk)
    for _ in range(total // chunk):
        yield block


def measure(name: str, pair: tuple[Callable[..., None], Callable[..., int]], args: Any) -> None:
    upload, download = pair
    size, chunk = args.mb << 20, args.chunk_mib << 20
    times: dict[str, list[float]] = {"upload": [], "download": []}
    for n in range(args.repeats):
        start = time.perf_counter()
        upload(f"object-{n}", _chunks(size, chunk))
        times["upload"].append(time.perf_counter() - start)
        start = time.perf_counter()
        assert download(f"object-{n}", chunk) == size
        times["download"].append(time.perf_counter() - start)
    for direction, seconds in times.items():
        rates = [args.mb / s for s in seconds]
        print(json.dumps({"library": name, "direction": direction, "mib": args.mb,
                          "best_mib_s": round(max(rates), 1),
                          "median_mib_s": round(statistics.median(rates), 1)}), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=1)
    parser.add_argument("--part-mib", type=int, default=8)
    args = parser.parse_args()
    os.environ.update(_KEYS)
    with moto_server() as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        part = args.part_mib << 20
        measure("s3fs", s3fs_pair(endpoint, part), args)
        measure("obstore", obstore_pair(endpoint, part), args)


if __name__ == "__main__":
    main()
