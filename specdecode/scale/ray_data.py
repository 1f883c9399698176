"""`specdecode batch --ray`: the same job on Ray Data. The input's pending rows become a Ray dataset;
`map_batches` runs them through a pool of actors, each holding one SpeculativeDecoder and decoding
its batches with scale.batch.decode_rows (so a row's record is what the local run writes); this
process appends each record to the output as it arrives, so resuming works as for the local run.

Nothing is shared between workers but the input rows and the records: N workers decode N disjoint
slices of the dataset, so throughput scales with the actors a cluster can place (each needs a
decoder's memory and its CPUs), until the one writer (this process) or the input read bounds it.
"""

from __future__ import annotations

import json
import math
import time

import ray
import ray.data

from specdecode.scale.batch import BatchSummary, job
from specdecode.scale.cluster import check_models, connect, disconnect, use_assigned_cpus
from specdecode.scale.rows import RowDefaults, error_record, parse_line

class DecoderWorker:
    """A Ray Data callable class: one SpeculativeDecoder per actor, built once in the actor.

    Args:
        config: a DecoderConfig's fields (DecoderConfig.plain()).  defaults: RowDefaults.
        max_batch_size: rows decoded together.
    Call: a batch {"line": int array, "text": str array, "openai": bool array (the file's format)} of input lines → {"record": JSON strings,
        one per line (results and error records); "started", "ended": the call's start and end on
        this node's clock (Unix seconds, float64), repeated per line}.
    """

    def __init__(self, config: dict, defaults: RowDefaults, max_batch_size: int):
        from specdecode import SpeculativeDecoder
        from specdecode.config import DecoderConfig

        from specdecode.engine.threads import free_openmp_threads

        use_assigned_cpus()
        self.decoder = SpeculativeDecoder.from_config(DecoderConfig(**config))
        self.defaults, self.max_batch_size = defaults, max_batch_size
        # Ray Data calls this object from a pool thread, not the one that built it: free this
        # thread's OpenMP workers, or every parallel region there runs throttled (engine/threads.py)
        free_openmp_threads()

    def __call__(self, batch: dict) -> dict:
        from specdecode.scale.batch import decode_rows

        started = time.time()
        use_assigned_cpus()  # torch's thread count is per thread under OpenMP
        rows = [parse_line(str(text), int(line), self.defaults, bool(openai))
                for line, text, openai in zip(batch["line"], batch["text"], batch["openai"])]
        records = decode_rows(self.decoder, rows, self.max_batch_size, self.defaults.model)
        ended = time.time()
        return {"record": [json.dumps(r, ensure_ascii=False) for r in records],
                "started": [started] * len(records), "ended": [ended] * len(records)}


def run_batch_on_ray(config: dict, input_path: str, output_path: str, defaults: RowDefaults = RowDefaults(),
                     *, address: str | None = None, workers: int = 1, cpus_per_worker: float | None = None,
                     rows_per_task: int = 32, max_batch_size: int = 8, on_update=None,
                     quiet: bool = False) -> BatchSummary:
    """Runs (or resumes) a batch job on Ray Data; returns its summary.

    Args:
        config: a DecoderConfig's fields (DecoderConfig.plain()); every actor builds its own decoder from them
            (the models must be loadable on every node: installed extras, or local paths there).
        address: a running cluster ("auto", "ray://host:10001", ...), or None to start a local one
            (shut down at the end) with this machine's CPUs.
        workers: actors, one decoder each.  cpus_per_worker: CPUs each reserves (and its torch
            threads); None: the cluster's CPUs / workers for a local cluster, else 1.
        rows_per_task: input rows per actor call, decoded as one continuous batch of up to
            max_batch_size; a crash redoes at most this many rows per worker.
        on_update: as scale.batch.run_batch.
    Raises:
        OSError, ValueError: as scale.batch.run_batch, or (for a local cluster) a model that cannot
            load here (before Ray starts).
    """
    if address is None:
        check_models(config)
    with job(input_path, output_path, defaults, on_update) as (rows, summary, write):
        for row in rows:  # bad lines need no decoder
            if row.error is not None:
                write(error_record(row))
        good = [row for row in rows if row.error is None]
        if good:
            with open(input_path, "rb") as f:
                lines = f.read().split(b"\n")
            items = [{"line": row.line, "text": lines[row.line - 1].decode("utf-8"), "openai": row.openai}
                     for row in good]
            started = connect(address, quiet)
            try:
                if cpus_per_worker is None:
                    cpus_per_worker = max(1.0, ray.cluster_resources().get("CPU", 1) // workers) if started else 1.0
                context = ray.data.DataContext.get_current()
                context.enable_progress_bars = False  # the job draws its own
                dataset = ray.data.from_items(items, override_num_blocks=math.ceil(len(items) / rows_per_task))
                records = dataset.map_batches(
                    DecoderWorker, fn_constructor_kwargs=dict(config=config, defaults=defaults,
                                                              max_batch_size=max_batch_size),
                    batch_size=rows_per_task, compute=ray.data.ActorPoolStrategy(size=workers),
                    num_cpus=cpus_per_worker, batch_format="numpy")
                first, last = math.inf, -math.inf
                for batch in records.iter_batches(batch_size=None, batch_format="numpy"):
                    first, last = min(first, batch["started"].min()), max(last, batch["ended"].max())
                    summary.decode_time_s = last - first
                    for text in batch["record"]:
                        write(json.loads(str(text)))
            finally:
                disconnect(started)
    return summary
