"""Merge shard DBs into one: the per-shard runs of one night become one run.

Each nightly shard (``portharness run --shard i/N``) starts its own run in its own DB. Merged, they
must read as one night to the matrix, report and diff, without ever mixing two nights: shards of the
same (list, target, settings, N) are combined only when every shard index appears once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.outcomes import DEVICE_SIDE
from harness.results.dbfile import StoreError
from harness.results.schema import PLAN
from harness.results.store import TABLES, ResultStore
from harness.results.writable import check_writable, remove_db


def _parse_shard(shard: str) -> tuple[int, int] | None:
    try:
        i, n = shard.split("/")
        return int(i), int(n)
    except (ValueError, AttributeError):
        return None


def _combine_run_ids(runs: list[dict[str, Any]]) -> dict[str, str]:
    """Map shard run ids onto one run id per (list, target, settings, N) when the shards are distinct.

    Each nightly shard starts its own run; merged, they form one night. Shards of the same group
    are combined only when every shard index appears once, so two nights are never mixed up.
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        parsed = _parse_shard(r["shard"])
        if parsed is None or parsed[1] <= 1:
            continue
        groups.setdefault((r["list_name"], r["target"], r["settings"], parsed[1]), []).append(r)
    mapping: dict[str, str] = {}
    for members in groups.values():
        ids = {m["run_id"] for m in members}
        if len(ids) < 2:
            continue
        indices = [_parse_shard(m["shard"])[0] for m in members]  # type: ignore[index]
        if len(indices) != len(set(indices)):
            continue
        first = min(members, key=lambda m: (m["started_at"], m["run_id"]))
        for m in members:
            mapping[m["run_id"]] = first["run_id"]
    return mapping


def _merged_run(rows: list[dict[str, Any]], run_id: str) -> dict[str, Any]:
    base = dict(min(rows, key=lambda r: (r["started_at"], r["run_id"])))
    base["run_id"] = run_id
    parsed = [_parse_shard(r["shard"]) for r in rows]
    if all(parsed) and len({p[1] for p in parsed}) == 1 and len(rows) > 1:  # type: ignore[index]
        n = parsed[0][1]  # type: ignore[index]
        idx = sorted({p[0] for p in parsed})  # type: ignore[index]
        base["shard"] = "1/1" if idx == list(range(1, n + 1)) else f"{','.join(map(str, idx))}/{n}"
    # Copies of one shard's run (the destination's and a source's, an older copy merged again): the
    # shard is finished if any copy is. The merged run is finished when every shard is.
    by_shard: dict[str, list[str]] = {}
    for r in rows:
        by_shard.setdefault(str(r["shard"]), []).append(r["finished_at"] or "")
    finished = [max(f) for f in by_shard.values()]
    base["finished_at"] = "" if any(not f for f in finished) else max(finished)
    return base


@dataclass
class MergeResult:
    rows: int  # distinct rows written (an overlapping key counts once)
    overlaps: list[str] = field(default_factory=list)  # "<table> <model/op...>: kept <db> (<why>)"


def _completeness(row: dict[str, Any], finished: bool) -> tuple:
    """Which of two rows for one key to keep: a model's own result over a device error, a row of a
    finished run over an interrupted one, more attempts, then the later one."""
    attempts = row.get("attempts")
    n_attempts = len(json.loads(attempts)) if isinstance(attempts, str) and attempts.startswith("[") else 0
    return (row.get("outcome") not in DEVICE_SIDE, finished, n_attempts, row.get("finished_at") or "")


def merge_stores(
    dst: str | os.PathLike, srcs: Iterable[str | os.PathLike], *, combine_shards: bool = True
) -> MergeResult:
    """Merge shard DBs into ``dst`` (created if needed).

    Every source and the destination are validated first (missing, corrupt, foreign, read-only ->
    StoreError or OutputError, nothing written). With ``combine_shards`` the per-shard runs of one night
    become one run, so the matrix, report and diff see the whole night. Where two DBs (sources, or a
    source and the destination) have a row for the same key (overlapping shards, a run merged twice, an
    older copy of a shard) the more complete one is kept (`_completeness`) and the overlap is reported.
    Everything is written in one transaction: a failure (a full disk) leaves the destination as it was,
    and removes it if this merge created it.
    """
    dst_path = Path(dst)
    src_paths = [Path(s) for s in srcs]
    if not src_paths:
        raise StoreError("merge: no source DBs given.")
    for s in src_paths:
        if s.exists() and dst_path.exists() and s.resolve() == dst_path.resolve():
            raise StoreError(f"merge: source {s} is also the destination; pass a different --out.")
    opened = []
    created = not dst_path.exists()
    try:
        for s in src_paths:
            opened.append(ResultStore(s, read_only=True))
        check_writable(dst_path, create_parents=False)
        runs = [r for st in opened for r in st.raw_runs()]
        mapping = _combine_run_ids(runs) if combine_shards else {}
        with ResultStore(dst_path, create=True) as out, out.transaction():
            result = _merge_into(out, opened, src_paths, runs, mapping)
        created = False
        return result
    finally:
        for st in opened:
            st.close()
        if created:  # this merge made the destination and failed: leave nothing behind
            remove_db(dst_path)


def _merge_into(out: ResultStore, opened: list[ResultStore], src_paths: list[Path], runs: list[dict[str, Any]],
                mapping: dict[str, str]) -> MergeResult:
    existing = {r["run_id"]: r for r in out.raw_runs()}
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_id.setdefault(mapping.get(r["run_id"], r["run_id"]), []).append(r)
    out.put_raw_runs(
        [_merged_run([existing[rid], *rows] if rid in existing else rows, rid) for rid, rows in by_id.items()]
    )
    result = MergeResult(rows=0)
    dst_finished = {rid for rid, r in existing.items() if r.get("finished_at")}
    for table, spec in TABLES.items():
        # The destination's rows compete under the same rule as the sources' (a re-merged older copy of
        # a shard must not replace its finished rows).
        best: dict[tuple, tuple[tuple, dict[str, Any], Path | None]] = {
            tuple(r[c] for c in spec.key): (_completeness(r, r["run_id"] in dst_finished), r, None)
            for r in out.raw_rows(table)
        }
        from_sources: set[tuple] = set()
        for st, path in zip(opened, src_paths, strict=True):
            finished = {r["run_id"] for r in st.raw_runs() if r.get("finished_at")}
            for r in st.raw_rows(table):
                rank = _completeness(r, r["run_id"] in finished)
                r["run_id"] = mapping.get(r["run_id"], r["run_id"])
                key = tuple(r[c] for c in spec.key)
                from_sources.add(key)
                if key in best:
                    keep = rank > best[key][0]
                    if r != best[key][1]:  # the same row merged again is no overlap
                        kept = path if keep else best[key][2]
                        label = r.get("model_id") or r.get("op") or r.get("scenario") or ""
                        result.overlaps.append(f"{table} {label}: kept {kept.name if kept else out.path.name}")
                    if not keep:
                        continue
                best[key] = (rank, r, path)
        out.put_raw_rows(table, [r for _, r, src in best.values() if src is not None])
        result.rows += len(from_sources) if table != PLAN.name else 0  # what runs planned is no row of theirs
    return result
