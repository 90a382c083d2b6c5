"""`prefixgrove run` writes answers as they finish, in input order, and `--resume` picks up an
interrupted run: the files end byte for byte as one uninterrupted run leaves them."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from services_testbed import MAX_MODEL_LEN, MODEL, batch_line

from prefixgrove.cli import main as cli
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.held_answers import held_path, load_held
from prefixgrove.jobs.kept_answers import CHANGED, NO_FINGERPRINT
from prefixgrove.jobs.ordered_writer import (
    KEEP,
    NOT_THEIRS,
    Judged,
    OrderedWriter,
    ResumeMismatch,
    read_back,
)
from prefixgrove.jobs.output_lines import RUN_TAG_CHARS
from prefixgrove.local import Rerun, RunSummary, run_local
from prefixgrove.settings import IngestSettings

# Two requests at a time: the job takes several engine steps, and finishes over several of them.
ENGINE = EngineSettings(device="cpu", dtype="float32", seed=0, max_num_seqs=2)


def write_job(path: Path, tag: str = "c", shared: str = "") -> Path:
    lines = [
        batch_line(f"{tag}{i}", {"prompt": f"{shared}question {i}", "max_tokens": 3, "temperature": 0})
        for i in range(8)
    ]  # fmt: skip
    lines.insert(3, "{not json")
    lines.append(batch_line(f"{tag}-seeded", {"prompt": "roll", "max_tokens": 3, "seed": 7}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def errors_of(out: Path) -> Path:
    return out.with_name(out.stem + ".errors.jsonl")


def run(
    job: Path, out: Path, *, resume: bool = False, progress: Any = False, run_id: str | None = "r"
) -> RunSummary:
    """A local run; `run_id` (one for every run by default, so that runs may be compared byte
    for byte; None: the run's own)."""
    ingest = IngestSettings(max_model_len=MAX_MODEL_LEN)
    return run_local(job, out, errors_of(out), MODEL, ingest, ENGINE, use_tqdm=progress,
                     resume=resume, run_id=run_id or "")  # fmt: skip


def lines_in(out: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (out, errors_of(out)) if p.exists())


class Watch:
    """A progress bar that notes, at each update, how many lines the files already hold; with
    `stop_at`, it interrupts the run (as Ctrl-C does) once they hold that many."""

    def __init__(self, out: Path, stop_at: int | None = None) -> None:
        self.out, self.stop_at, self.seen = out, stop_at, list[int]()

    def __call__(self, **_: Any) -> Watch:
        return self

    def update(self, n: int) -> None:
        self.seen.append(lines_in(self.out))
        if self.stop_at is not None and self.seen[-1] >= self.stop_at:
            raise KeyboardInterrupt

    def set_postfix(self, **_: Any) -> None:
        pass

    def close(self) -> None:
        pass


def same_files(a: Path, b: Path) -> bool:
    return (
        a.read_bytes() == b.read_bytes() and errors_of(a).read_bytes() == errors_of(b).read_bytes()
    )


def test_the_writer_holds_a_line_until_every_line_before_it_is_answered() -> None:
    out, err = io.BytesIO(), io.BytesIO()
    writer = OrderedWriter(out, err)
    writer.put(2, "two")
    writer.put(1, "one failed", failed=True)
    writer.flush()
    assert out.getvalue() == err.getvalue() == b""
    writer.put(0, "zero")
    writer.flush()
    assert (out.getvalue(), err.getvalue()) == (b"zero\ntwo\n", b"one failed\n")


def test_lines_one_file_wrote_ahead_of_the_other_are_cut_back(tmp_path: Path) -> None:
    """Killed between its two flushes, a run leaves the error file answering line 3 while the
    output file stops at line 1: only lines 0 and 1 count as answered."""
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    out.write_text("ok0\nok1\nok")
    err.write_text("bad3\n")

    def judge(index: int, line: str, failed: bool) -> Judged:
        mine = line == (f"bad{index}" if index == 3 else f"ok{index}") and failed == (index == 3)
        return KEEP if mine else NOT_THEIRS

    done = read_back(out, err, 5, judge)
    assert (done.start, done.count, done.sizes, done.kept, done.stale) == (2, 2, (8, 0), {}, {})


def test_answers_reach_the_files_while_the_run_is_still_going(tmp_path: Path) -> None:
    job, out = write_job(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    watch = Watch(out)
    summary = run(job, out, progress=watch)
    assert lines_in(out) == summary.total == 10
    assert any(0 < seen < summary.total for seen in watch.seen), watch.seen
    assert watch.seen == sorted(watch.seen)


def test_an_interrupted_run_resumed_gives_the_files_of_an_uninterrupted_one(tmp_path: Path) -> None:
    job = write_job(tmp_path / "in.jsonl", shared="You grade answers. Be brief and exact. " * 4)
    whole, cut = tmp_path / "whole" / "out.jsonl", tmp_path / "cut" / "out.jsonl"
    run(job, whole)
    with pytest.raises(KeyboardInterrupt):
        run(job, cut, progress=Watch(cut, stop_at=4))
    written, held = lines_in(cut), len(load_held(cut))
    assert 4 <= written < 10
    summary = run(job, cut, resume=True)
    assert summary.skipped == written + held
    assert summary.completed + summary.failed == 10 - written - held
    assert same_files(cut, whole)
    assert not held_path(cut).exists()  # a run that wrote every line keeps nothing aside


class StopAfter(Watch):
    """Interrupts the run (as Ctrl-C does) once `requests` requests were answered."""

    def __init__(self, out: Path, requests: int) -> None:
        super().__init__(out)
        self.requests, self.answered = requests, 0

    def update(self, n: int) -> None:
        self.answered += n
        if self.answered >= self.requests:
            raise KeyboardInterrupt


def test_answers_behind_a_long_early_request_are_kept_for_resume_when_interrupted(
    tmp_path: Path,
) -> None:
    """The first request runs long: nothing can be written while it runs, yet the answers that
    finished behind it are kept beside the output at Ctrl-C, and --resume does not run them
    again."""
    job = write_job(tmp_path / "in.jsonl")
    rewrite_lines(job, {0: question("c0", "a long first answer", max_tokens=40)})
    whole, cut = tmp_path / "whole" / "out.jsonl", tmp_path / "cut" / "out.jsonl"
    run(job, whole)
    with pytest.raises(KeyboardInterrupt):
        run(job, cut, progress=StopAfter(cut, requests=4))
    assert lines_in(cut) == 0
    held = load_held(cut)
    assert len(held) == 5  # four answers and the invalid line's error, all after line 0
    summary = run(job, cut, resume=True)
    assert (summary.skipped, summary.completed + summary.failed) == (5, 5)
    assert same_files(cut, whole) and not held_path(cut).exists()


def test_a_fresh_run_drops_what_a_stopped_run_kept_for_resume(tmp_path: Path) -> None:
    job, out = write_job(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    rewrite_lines(job, {0: question("c0", "a long first answer", max_tokens=40)})
    with pytest.raises(KeyboardInterrupt):
        run(job, out, progress=StopAfter(out, requests=3))
    assert held_path(out).exists()
    summary = run(job, out)
    assert (summary.skipped, summary.completed + summary.failed) == (0, 10)
    assert not held_path(out).exists()


def test_a_torn_last_line_is_cut_and_answered_again(tmp_path: Path) -> None:
    job = write_job(tmp_path / "in.jsonl")
    whole, torn = tmp_path / "whole" / "out.jsonl", tmp_path / "torn" / "out.jsonl"
    run(job, whole)
    torn.parent.mkdir()
    shutil.copy(errors_of(whole), errors_of(torn))
    data = whole.read_bytes()
    fourth_line = data.index(b"\n", data.index(b"\n", data.index(b"\n") + 1) + 1) + 1
    torn.write_bytes(data[: fourth_line + 20])  # three lines and the start of a fourth
    summary = run(job, torn, resume=True)
    assert summary.skipped == 4  # three outputs and the bad line before them
    assert same_files(torn, whole)


def test_resume_refuses_the_files_of_another_input(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    run(write_job(tmp_path / "a.jsonl", tag="a"), out)
    before = out.read_bytes(), errors_of(out).read_bytes()
    with pytest.raises(ResumeMismatch, match="does not answer this input"):
        run(write_job(tmp_path / "b.jsonl", tag="b"), out, resume=True)
    assert (out.read_bytes(), errors_of(out).read_bytes()) == before


def test_resume_without_an_output_file_runs_the_whole_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job, out = write_job(tmp_path / "in.jsonl"), tmp_path / "new" / "out.jsonl"
    args = ["run", str(job), "-o", str(out), "--model", MODEL, "--device", "cpu", "--json",
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--resume"]  # fmt: skip
    assert cli(args) == 0
    assert '"skipped": 0' in capsys.readouterr().out
    assert lines_in(out) == 10


def rewrite_lines(job: Path, new: dict[int, str]) -> None:
    """Replaces the job's lines at these 0-based positions."""
    lines = job.read_text().splitlines()
    for index, line in new.items():
        lines[index] = line
    job.write_text("".join(line + "\n" for line in lines))


def question(custom_id: str, prompt: str, max_tokens: int = 3) -> str:
    return batch_line(custom_id, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_lines_whose_request_changed_run_again_and_the_rest_are_kept(tmp_path: Path) -> None:
    """Same custom_ids, a new prompt on one line and a new max_tokens on another: those two run
    again, the rest are kept, and the files end as a fresh run of the new input leaves them."""
    job, out = write_job(tmp_path / "in.jsonl"), tmp_path / "resumed" / "out.jsonl"
    run(job, out)
    rewrite_lines(job, {1: question("c1", "another question"), 6: question("c5", "question 5", 5)})
    summary = run(job, out, resume=True)
    assert summary.rerun == (Rerun(2, "c1", CHANGED), Rerun(7, "c5", CHANGED))
    assert (summary.skipped, summary.completed, summary.failed) == (8, 2, 0)
    fresh = tmp_path / "fresh" / "out.jsonl"
    run(job, fresh)
    assert same_files(out, fresh)


def test_a_line_fixed_since_it_failed_runs_and_one_broken_since_fails(tmp_path: Path) -> None:
    job, out = write_job(tmp_path / "in.jsonl"), tmp_path / "resumed" / "out.jsonl"
    run(job, out)
    rewrite_lines(job, {3: question("fixed", "question 3"), 5: "{broken since"})
    summary = run(job, out, resume=True)
    assert summary.rerun == (
        Rerun(4, "fixed", "was an error (invalid_json), now runs"),
        Rerun(6, None, "now fails (invalid_json)"),  # a line that does not parse names none
    )
    fresh = tmp_path / "fresh" / "out.jsonl"
    run(job, fresh)
    assert same_files(out, fresh)


def test_answers_written_without_a_request_fingerprint_run_again(tmp_path: Path) -> None:
    """Output ids of earlier versions name the position and custom_id only (`batch_req_<h>`):
    nothing ties such an answer to its request, so it is answered again."""
    job, out = write_job(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    run(job, out)
    answered = out.read_bytes()
    old = [json.loads(line) for line in out.read_text().splitlines()]
    for line in old:
        line["id"] = line["id"][: len("batch_req_") + len(line["response"]["request_id"])]
    out.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in old))
    summary = run(job, out, resume=True)
    assert [r.reason for r in summary.rerun] == [NO_FINGERPRINT] * 9
    assert (summary.skipped, summary.completed) == (1, 9)  # the invalid line's error is kept
    assert out.read_bytes() == answered


def test_the_run_summary_names_each_line_run_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job, out = write_job(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    run(job, out)
    rewrite_lines(job, {0: question("c0", "a new first question")})
    args = ["run", str(job), "-o", str(out), "--model", MODEL, "--device", "cpu", "--dtype",
            "float32", "--max-model-len", str(MAX_MODEL_LEN), "--resume"]  # fmt: skip
    assert cli([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rerun"] == [{"line": 1, "custom_id": "c0", "reason": CHANGED}]
    rewrite_lines(job, {0: question("c0", "and another one")})
    assert cli(args) == 0
    said = capsys.readouterr()
    assert "1 answered before, run again: line 1 (c0): request changed" in said.out
    assert "answered lines run again, their answers being stale: line 1 (c0)" in said.err


def ids_of(out: Path) -> list[str]:
    return [
        json.loads(line)["id"] for p in (out, errors_of(out)) for line in p.read_text().splitlines()
    ]


def test_runs_never_share_an_id_and_a_resumed_run_goes_on_under_its_own(tmp_path: Path) -> None:
    """Each run tags its ids with a run tag of its own (output_lines.run_tag); a resumed run takes
    up the tag of the answers it keeps, so one job's files carry one tag."""
    job = write_job(tmp_path / "in.jsonl")
    first, second = tmp_path / "a" / "out.jsonl", tmp_path / "b" / "out.jsonl"
    run(job, first, run_id=None)
    run(job, second, run_id=None)
    assert not set(ids_of(first)) & set(ids_of(second))
    with pytest.raises(KeyboardInterrupt):
        run(job, second, progress=Watch(second, stop_at=4), run_id=None)
    run(job, second, resume=True, run_id=None)
    tags = {i.removeprefix("batch_req_")[:RUN_TAG_CHARS] for i in ids_of(second)}
    assert len(tags) == 1 and len(ids_of(second)) == 10
