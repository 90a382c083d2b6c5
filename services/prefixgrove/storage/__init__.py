"""Inputs and outputs in object storage (`s3://bucket/key`, `gs://bucket/key`), through obstore.

| module | holds |
|---|---|
| `locations.py` | what a URL names (scheme, bucket, key), refused with the reason when it names nothing |
| `stores.py` | one client per bucket, credentials the platform's way; errors named for people |
| `objects.py` | reading an object as a stream of bounded chunks, small writes, listing, deleting |
| `staged.py` | an output written as bounded parts, resumable, committed atomically under its name |

An output `s3://b/out.jsonl` is staged as parts `s3://b/out.jsonl.prefixgrove-parts/part-000001`...
while it is written; the object under its own name appears only when the writer commits, whole.
"""
