"""What `--resume` continues: the unfinished run of the same (list, target, settings, shard), and only with a
selection that covers every job it planned and has not finished (`harness.results.rows.PlannedRow`): a
narrower --limit or --only would run part of it and leave the rest to no later resume."""

from __future__ import annotations

import os

from harness.fleet import policy
from harness.results.store import ResultStore


def resumable(store: ResultStore, ids: list[str], list_name: str, target: str, settings: dict,
              shard_spec: str) -> str | None:
    """The unfinished run of this (list, target, settings, shard) that `--resume` continues with `ids`, or
    None (a new run starts). ValueError when `ids` leave out jobs that run planned and has not finished: a
    narrower --limit or --only would run part of it, and the rest would be lost to every later resume."""
    run_id = store.latest_run(list_name=list_name, target=target, settings=settings, shard=shard_spec,
                              unfinished_only=True)
    if run_id is None:
        return None
    left = policy.left_out(store.planned(run_id), store.finished_ids(run_id), ids)
    if left:
        raise ValueError(
            f"--resume: run {run_id} has {len(left)} unfinished job(s) this selection leaves out "
            f"({', '.join(sorted(left)[:3])}{' ...' if len(left) > 3 else ''}); a resume continues the whole run: "
            "drop the narrower --limit/--only, or leave out --resume to start a new run")
    return run_id


def check_resume(db: str | os.PathLike, ids: list[str], list_name: str, target: str, settings: dict,
                 shard_spec: str) -> None:
    """`resumable`'s refusal before anything is written (the CLI, before its banner); nothing to check in a
    DB that does not exist yet."""
    if not os.path.exists(db):
        return
    with ResultStore(db, read_only=True) as store:
        resumable(store, ids, list_name, target, settings, shard_spec)
