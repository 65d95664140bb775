"""The Ray Data engine of ``datapipe shard --engine ray``.

Each partition becomes one row of a Ray dataset; ``Dataset.map`` runs
:func:`datapipe.jobs.shard.partition.run_partition` on the cluster's workers, which read the input and
write part shards and done markers straight to the output storage (any fsspec URL every worker
can reach; a local path only on a one-machine cluster). The driver collects the markers and
commits, exactly as with the local engine, so the shards are the same.

Ray is imported only here. ``ray.init()`` is called when Ray is not initialised yet: it
connects to the cluster named by ``RAY_ADDRESS`` when that is set (Ray's own rule), else starts
a local one.
"""
from __future__ import annotations

import json
from typing import Callable, Iterator


def _ray_partition(row: dict, *, job_json: str) -> dict:
    """One partition on a Ray worker; strict-mode failures come back as rows (not Ray errors)."""
    from datapipe.errors import DataError
    from datapipe.jobs.shard.partition import run_partition

    job = json.loads(job_json)
    try:
        marker = run_partition(job, json.loads(row["part"]))
    except DataError as e:
        return {"marker": "", "error": str(e)}
    return {"marker": json.dumps(marker), "error": ""}


def run_ray(job: dict, parts: list[dict], *, workers: int, progress: Callable[[int, int], None]) -> Iterator[dict]:
    """Run partitions as Ray Data tasks (at most ``workers`` at once); yield done markers as they finish."""
    from datapipe.errors import DataError
    from datapipe.extras import require

    ray = require("ray", what="datapipe shard --engine ray")
    require("ray.data", what="datapipe shard --engine ray")

    if not parts:
        return
    if not ray.is_initialized():
        ray.init()
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ds = ray.data.from_items([{"part": json.dumps(p)} for p in parts], override_num_blocks=len(parts))
    ds = ds.map(_ray_partition, fn_kwargs={"job_json": json.dumps(job)}, num_cpus=1, concurrency=max(1, workers))
    for row in ds.iter_rows():
        if row["error"]:
            raise DataError(row["error"])
        marker = json.loads(row["marker"])
        progress(marker["samples"], marker["bytes"])
        yield marker
