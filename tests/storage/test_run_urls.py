"""`prefixgrove run` with its input and outputs in a bucket: the same bytes as a run on local
files, a resume from the parts an interrupted run left, and errors that name the URL and the
cause (no such bucket, wrong credentials: never the secret itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from object_store_testbed import S3Server
from services_testbed import MAX_MODEL_LEN, MODEL
from test_local_resume import ENGINE, Watch, run, write_job

from prefixgrove.held_answers import load_held
from prefixgrove.local import run_local
from prefixgrove.output_files import read_output
from prefixgrove.settings import IngestSettings


def run_urls(job: str, out: str, *, resume: bool = False, progress: object = False) -> object:
    ingest = IngestSettings(max_model_len=MAX_MODEL_LEN)
    errors = out.removesuffix(".jsonl") + ".errors.jsonl"
    return run_local(job, out, errors, MODEL, ingest, ENGINE, use_tqdm=progress, resume=resume,
                     run_id="r")  # type: ignore[arg-type]  # fmt: skip


@pytest.fixture
def local_answers(tmp_path: Path) -> tuple[Path, bytes, bytes]:
    """A job, and the files a run on local files gives it."""
    job = write_job(tmp_path / "in.jsonl", shared="You grade answers. Be brief and exact. " * 4)
    out = tmp_path / "out.jsonl"
    run(job, out)
    return job, out.read_bytes(), (tmp_path / "out.errors.jsonl").read_bytes()


def test_a_run_from_a_bucket_to_a_bucket_writes_what_a_local_run_writes(
    s3: S3Server, local_answers: tuple[Path, bytes, bytes]
) -> None:
    job, output, errors = local_answers
    bucket = s3.bucket()
    s3.put(bucket, "in/requests.jsonl", job.read_bytes())
    run_urls(f"s3://{bucket}/in/requests.jsonl", f"s3://{bucket}/out/answers.jsonl")
    assert s3.get(bucket, "out/answers.jsonl") == output
    assert s3.get(bucket, "out/answers.errors.jsonl") == errors
    assert s3.keys(bucket) == ["in/requests.jsonl", "out/answers.errors.jsonl", "out/answers.jsonl"]


def test_an_interrupted_run_resumes_from_the_parts_it_uploaded(
    s3: S3Server, local_answers: tuple[Path, bytes, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, output, errors = local_answers
    monkeypatch.setenv("PREFIXGROVE_OBJECT_PART_BYTES", "1024")  # a part after every few answers
    bucket = s3.bucket()
    out = f"s3://{bucket}/answers.jsonl"
    watch = Watch(Path("/nonexistent"), stop_at=None)
    watch.update = _stop_after_parts(s3, bucket)  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        run_urls(str(job), out, progress=watch)
    assert "answers.jsonl" not in s3.keys(bucket)
    kept = read_output(out).count(b"\n") + read_output(
        out.replace(".jsonl", ".errors.jsonl")
    ).count(b"\n")
    assert 0 < kept < 10
    held = len(load_held(out))  # answers past the first unanswered line, kept beside the output
    summary = run_urls(str(job), out, resume=True)
    assert summary.skipped == kept + held  # type: ignore[attr-defined]
    assert "answers.jsonl.held.jsonl" not in s3.keys(bucket)
    assert s3.get(bucket, "answers.jsonl") == output
    assert s3.get(bucket, "answers.errors.jsonl") == errors


def _stop_after_parts(s3: S3Server, bucket: str) -> object:
    def update(n: int) -> None:
        if any(".prefixgrove-parts/" in key for key in s3.keys(bucket)):
            raise KeyboardInterrupt

    return update


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "prefixgrove.cli", "run", *args, "--model", MODEL,
               "--device", "cpu", "--quiet"]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_a_missing_bucket_is_named_with_the_url(s3: S3Server, tmp_path: Path) -> None:
    done = cli("s3://no-such-bucket-here/in.jsonl", "-o", str(tmp_path / "o.jsonl"))
    assert done.returncode != 0
    assert "s3://no-such-bucket-here/in.jsonl" in done.stderr and "no such bucket" in done.stderr


def test_an_output_in_a_missing_bucket_is_refused_before_anything_runs(
    s3: S3Server, tmp_path: Path
) -> None:
    job = write_job(tmp_path / "in.jsonl")
    done = cli(str(job), "-o", "s3://no-such-bucket-for-output/o.jsonl")
    assert done.returncode != 0
    assert "s3://no-such-bucket-for-output/o.jsonl" in done.stderr
    assert "no such bucket" in done.stderr


def test_a_missing_object_and_a_bad_url_are_one_line_each(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.bucket()
    missing = cli(f"s3://{bucket}/absent.jsonl", "-o", str(tmp_path / "o.jsonl"))
    assert (
        missing.returncode == 2 and f"s3://{bucket}/absent.jsonl: no such object" in missing.stderr
    )
    scheme = cli("ftp://host/in.jsonl", "-o", str(tmp_path / "o.jsonl"))
    assert scheme.returncode != 0 and "ftp:// is not served" in scheme.stderr
    no_key = cli(f"s3://{bucket}", "-o", str(tmp_path / "o.jsonl"))
    assert no_key.returncode != 0 and "no object key" in no_key.stderr


def test_wrong_credentials_are_named_and_the_secret_never_shows(
    s3: S3Server, tmp_path: Path
) -> None:
    import os

    bucket = s3.bucket()
    s3.put(bucket, "in.jsonl", write_job(tmp_path / "in.jsonl").read_bytes())
    secret = "wRoNgSeCrEt/0123456789abcdefghijklmnopqrstuv"
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "AKIAWRONGKEYID000001",
        "AWS_SECRET_ACCESS_KEY": secret,
    }
    done = cli(
        f"s3://{bucket}/in.jsonl", "-o", f"s3://{bucket}/o.jsonl", "--log-format", "json", env=env
    )
    assert done.returncode != 0
    assert f"s3://{bucket}/in.jsonl" in done.stderr and "wrong credentials" in done.stderr
    assert secret not in done.stderr + done.stdout
    assert secret[:12] not in done.stderr + done.stdout
