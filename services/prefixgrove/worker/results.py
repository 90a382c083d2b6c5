"""Results on their way to Redis: each answered or failed request's output line, kept until the end
of the loop's iteration and then written in one batch per job. A write that fails (Redis away, or
out of memory: redis_full.py) keeps them all, to be written again: the store keeps the first result
of a line index, so a result is never doubled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixgrove.jobs.output_lines import failed_output, run_tag, success_line
from prefixgrove.jobs.redis_store.schema import ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.worker.flights import InFlight
from prefixgrove.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from prefixgrove.engine import RequestOutput


@dataclass
class Pending:
    job_id: str
    index: int
    result: ResultRecord
    completion_tokens: int


class Results:
    def __init__(
        self, store: JobStore, metrics: WorkerMetrics, served_name: str, tokenizer: Any
    ) -> None:
        """`served_name`: the model output lines name when the request named none; `tokenizer`:
        the engine's, for the text of outputs."""
        self.store = store
        self.metrics = metrics
        self.served_name = served_name
        self.tokenizer = tokenizer
        self.pending: list[Pending] = []

    def fail(self, job_id: str, error: RequestError) -> None:
        line = error.to_line(run_tag(job_id))
        self.pending.append(Pending(job_id, error.index, ResultRecord(True, line), 0))
        self.metrics.requests_failed.inc()

    def answer(self, flight: InFlight, out: RequestOutput) -> None:
        """The output line of a request the engine finished; the flight has it no more to answer."""
        index, record = flight.requests[out.request_id]
        failed = failed_output(out)
        if failed is not None:  # the engine ended it as an error: its error line, not an answer
            self.fail(flight.lease.job_id, RequestError(index, record.custom_id, *failed))
            flight.outstanding.discard(out.request_id)
            return
        line = success_line(index, record.custom_id, record.endpoint, record.params,
                            self.served_name, out, self.tokenizer, requested_model=record.model,
                            tag=run_tag(flight.lease.job_id))  # fmt: skip
        tokens = sum(len(c.token_ids) for c in out.outputs)
        self.pending.append(Pending(flight.lease.job_id, index, ResultRecord(False, line), tokens))
        flight.outstanding.discard(out.request_id)
        self.metrics.answered(tokens)

    def write(self) -> None:
        self.metrics.results_unwritten.set(len(self.pending))
        by_job: dict[str, list[tuple[int, ResultRecord, int]]] = {}
        for p in self.pending:
            by_job.setdefault(p.job_id, []).append((p.index, p.result, p.completion_tokens))
        for job_id, results in by_job.items():
            self.store.write_results(job_id, results)
        self.pending.clear()  # only once every write went through: a failed write is retried
        self.metrics.results_unwritten.set(0)
