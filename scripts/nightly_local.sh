#!/usr/bin/env bash
# Run the nightly pipeline locally, with the same steps as .github/workflows/nightly.yml:
#   shards (portharness run --shard i/N) -> merge -> report -> diff against a previous merged DB.
#
# usage: scripts/nightly_local.sh [LIST] [SHARDS]
#   LIST    model list name or CSV path (default tiny-zoo)
#   SHARDS  number of shards (default 2)
# environment:
#   OUT=DIR            where shard DBs, merged.db and site/ go (default artifacts/nightly-local)
#   PREV_DB=PATH       previous night's merged DB: adds the diff page and gates on regressions
#   TARGET=sim         target backend (default sim)
#   PARALLEL=1         run the shards concurrently (default: one after another)
#   LIMIT=N            only the first N models of each shard (quick checks)
#   JOBS=N             worker processes per shard (default: CPUs, divided by SHARDS when PARALLEL=1)
#   FLAKY_ALLOWLIST=F  known-flaky model ids, not counted as regressions
#   PORTHARNESS="..."  the CLI to call (default: portharness, or python -m harness.cli)
# exit status: 0 ok; 1 regressions vs PREV_DB; 2 bad input; otherwise the failing step's status.
set -euo pipefail

LIST="${1:-tiny-zoo}"
SHARDS="${2:-2}"
OUT="${OUT:-artifacts/nightly-local}"
TARGET="${TARGET:-sim}"
PARALLEL="${PARALLEL:-0}"
LIMIT="${LIMIT:-}"
PREV_DB="${PREV_DB:-}"
FLAKY_ALLOWLIST="${FLAKY_ALLOWLIST:-}"
if [[ -z "${PORTHARNESS:-}" ]]; then
  if command -v portharness >/dev/null 2>&1; then PORTHARNESS="portharness"; else PORTHARNESS="python -m harness.cli"; fi
fi

if ! [[ "$SHARDS" =~ ^[1-9][0-9]*$ ]]; then
  echo "nightly_local: SHARDS must be a positive integer, got '$SHARDS'" >&2
  exit 2
fi
if [[ -n "$PREV_DB" && ! -f "$PREV_DB" ]]; then
  echo "nightly_local: PREV_DB=$PREV_DB does not exist" >&2
  exit 2
fi

CPUS="$(nproc 2>/dev/null || echo 2)"
if [[ -z "${JOBS:-}" ]]; then
  if [[ "$PARALLEL" == "1" ]]; then JOBS=$(( CPUS / SHARDS )); else JOBS="$CPUS"; fi
  (( JOBS >= 1 )) || JOBS=1
fi

mkdir -p "$OUT"
# Fresh shard DBs each time: a stale shard from an earlier invocation must not leak into the merge.
rm -f "$OUT"/shard-*.db "$OUT"/shard-*.db-wal "$OUT"/shard-*.db-shm "$OUT"/merged.db "$OUT"/merged.db-wal "$OUT"/merged.db-shm

run_shard() {
  local i="$1"
  local args=(run --list "$LIST" --target "$TARGET" --shard "$i/$SHARDS" --db "$OUT/shard-$i.db" --jobs "$JOBS" --quiet)
  if [[ -n "$LIMIT" ]]; then args+=(--limit "$LIMIT"); fi
  echo "== shard $i/$SHARDS: $PORTHARNESS ${args[*]}" >&2
  # shellcheck disable=SC2086
  $PORTHARNESS "${args[@]}" > "$OUT/shard-$i.log" 2>&1 || { local rc=$?; echo "shard $i failed (exit $rc); see $OUT/shard-$i.log" >&2; tail -20 "$OUT/shard-$i.log" >&2; return "$rc"; }
}

failed=0
if [[ "$PARALLEL" == "1" ]]; then
  pids=()
  for i in $(seq 1 "$SHARDS"); do run_shard "$i" & pids+=("$!"); done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
else
  for i in $(seq 1 "$SHARDS"); do run_shard "$i" || failed=1; done
fi

shopt -s nullglob
dbs=("$OUT"/shard-*.db)
if (( ${#dbs[@]} == 0 )); then
  echo "nightly_local: no shard DBs were produced" >&2
  exit 1
fi

echo "== merge" >&2
# shellcheck disable=SC2086
$PORTHARNESS merge --out "$OUT/merged.db" "${dbs[@]}"

echo "== report" >&2
report_args=(report --db "$OUT/merged.db" --out "$OUT/site")
if [[ -n "$PREV_DB" ]]; then report_args+=(--base-db "$PREV_DB"); fi
# shellcheck disable=SC2086
$PORTHARNESS "${report_args[@]}"

rc=0
if [[ -n "$PREV_DB" ]]; then
  echo "== diff vs $PREV_DB" >&2
  diff_args=(diff --base-db "$PREV_DB" --head-db "$OUT/merged.db")
  if [[ -n "$FLAKY_ALLOWLIST" ]]; then diff_args+=(--flaky-allowlist "$FLAKY_ALLOWLIST"); fi
  set +e
  # shellcheck disable=SC2086
  $PORTHARNESS "${diff_args[@]}" | tee "$OUT/diff.txt"
  rc="${PIPESTATUS[0]}"
  set -e
else
  echo "== diff skipped (set PREV_DB=path/to/previous/merged.db to gate on regressions)" >&2
fi

echo "nightly_local: report at $OUT/site/index.html; merged DB at $OUT/merged.db" >&2
if (( failed )); then
  echo "nightly_local: at least one shard failed" >&2
  exit 1
fi
exit "$rc"
