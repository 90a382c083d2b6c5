"""The S3-compatible server every test of this folder works against (object_store_testbed.py)."""

from object_store_testbed import s3, s3_server  # noqa: F401
