#!/usr/bin/env bash
# Run the nightly pipeline locally, with the same steps as .github/workflows/nightly.yml:
#   for each settings string: shards (portharness run --shard i/N) -> merge (one run per setting)
#   -> baseline check against the committed expected files -> history append -> report (one site for
#   the night, with the trend page) -> diff against a previous merged DB -> job summary (summary.md).
#
# usage: scripts/nightly_local.sh [LIST] [SHARDS]
#   LIST    model list name or CSV path (default tiny-zoo)
#   SHARDS  number of shards per setting (default 2)
# environment:
#   OUT=DIR            where shard DBs, merged.db, site/, baseline.txt, summary.md go (default artifacts/nightly-local)
#   TARGET=sim         target backend (default sim)
#   BACKEND=MODULE     a module that registers the target's backend (portharness run --backend)
#   SETTINGS=...       one settings string per line, each one configuration of the night
#                      (default "--precision default"; e.g. $'--precision default\n--precision highest --ops full')
#   EXPECTED_DIR=DIR   expected-outcome files, model_lists/expected/<list>--<target>--<settings>.csv (default
#                      model_lists/expected); the baseline check gates on them (exit 2 when one is missing)
#   UPDATE_BASELINE=1  write tonight's expected files into EXPECTED_DIR first (a new configuration, or after a fix)
#   NO_BASELINE=1      skip the baseline check
#   FLAKY=FILE         flaky list with reasons for the baseline check (default EXPECTED_DIR/flaky.txt if present)
#   HISTORY=FILE       nightly history to append to (default OUT/history.jsonl); the report draws its trend page
#   NIGHT_DATE=DATE    the night's date in the history (default: the runs' start date)
#   RERUN_FLAKY=N      re-run models whose attempts disagreed N times (portharness run --rerun-flaky N)
#   PROPOSED_DIR=DIR   also write tonight's expected files here, for review (CI uploads them as an artifact)
#   STEPS=all          all (default); shards: only run shards (SHARD_ONLY=i: only shard i of each setting);
#                      night: only the steps after the shards, over the shard DBs already in OUT. The nightly
#                      workflow runs its shard jobs with STEPS=shards and its night job with STEPS=night.
#   PREV_DB=PATH       previous night's merged DB: adds the diff page and gates on regressions
#   PARALLEL=1         run every (setting, shard) concurrently (default: one after another)
#   LIMIT=N            only the first N models of each shard (quick checks)
#   JOBS=N             worker processes per shard (default: CPUs, divided by the concurrent shards when PARALLEL=1;
#                      with RAY_ADDRESS: one actor per device of the cluster)
#   RAY_ADDRESS=ADDR   run on a Ray cluster (portharness run --executor ray --ray-address ADDR: auto, HOST:PORT or
#                      ray://HOST:PORT), one actor per device of every node; use SHARDS=1 (the cluster spreads the list)
#   FLAKY_ALLOWLIST=F  known-flaky model ids, not counted as regressions by the diff
#   PERF_ALLOWLIST=F   known-noisy model ids whose perf regressions do not gate (diff and baseline check
#                      --perf-allowlist); a settings string with --perf times every model after its verdict
#   PERF_REGRESSION=X  slowdown that is a perf regression when beyond noise (default 1.2)
#   PORTHARNESS="..."  the CLI to call (default: portharness, or python -m harness.cli)
# exit status: 0 ok; 1 a regression (baseline check or diff vs PREV_DB) or a failed shard; 2 bad input.
set -euo pipefail

LIST="${1:-tiny-zoo}"
SHARDS="${2:-2}"
OUT="${OUT:-artifacts/nightly-local}"
TARGET="${TARGET:-sim}"
BACKEND="${BACKEND:-}"
SETTINGS="${SETTINGS:---precision default}"
EXPECTED_DIR="${EXPECTED_DIR:-model_lists/expected}"
UPDATE_BASELINE="${UPDATE_BASELINE:-0}"
NO_BASELINE="${NO_BASELINE:-0}"
HISTORY="${HISTORY:-$OUT/history.jsonl}"
NIGHT_DATE="${NIGHT_DATE:-}"
RERUN_FLAKY="${RERUN_FLAKY:-}"
PARALLEL="${PARALLEL:-0}"
PROPOSED_DIR="${PROPOSED_DIR:-}"
STEPS="${STEPS:-all}"
SHARD_ONLY="${SHARD_ONLY:-}"
LIMIT="${LIMIT:-}"
PREV_DB="${PREV_DB:-}"
FLAKY_ALLOWLIST="${FLAKY_ALLOWLIST:-}"
PERF_ALLOWLIST="${PERF_ALLOWLIST:-}"
PERF_REGRESSION="${PERF_REGRESSION:-1.2}"
if [[ -z "${FLAKY:-}" && -f "$EXPECTED_DIR/flaky.txt" ]]; then FLAKY="$EXPECTED_DIR/flaky.txt"; fi
FLAKY="${FLAKY:-}"
if [[ -z "${PORTHARNESS:-}" ]]; then
  if command -v portharness >/dev/null 2>&1; then PORTHARNESS="portharness"; else PORTHARNESS="python -m harness.cli"; fi
fi

if ! [[ "$SHARDS" =~ ^[1-9][0-9]*$ ]]; then
  echo "nightly_local: SHARDS must be a positive integer, got '$SHARDS'" >&2
  exit 2
fi
if [[ -n "$PERF_ALLOWLIST" && ! -f "$PERF_ALLOWLIST" ]]; then
  echo "nightly_local: PERF_ALLOWLIST=$PERF_ALLOWLIST does not exist" >&2
  exit 2
fi
if [[ -n "$PREV_DB" && ! -f "$PREV_DB" ]]; then
  echo "nightly_local: PREV_DB=$PREV_DB does not exist" >&2
  exit 2
fi
case "$STEPS" in all|shards|night) ;; *) echo "nightly_local: STEPS must be all, shards or night, got '$STEPS'" >&2; exit 2;; esac
if [[ -n "$SHARD_ONLY" ]] && ! [[ "$SHARD_ONLY" =~ ^[1-9][0-9]*$ && "$SHARD_ONLY" -le "$SHARDS" ]]; then
  echo "nightly_local: SHARD_ONLY must be a shard index from 1 to $SHARDS, got '$SHARD_ONLY'" >&2
  exit 2
fi
mapfile -t SETTING_LINES < <(printf '%s\n' "$SETTINGS" | sed -e 's/^[[:space:]]*//' -e '/^$/d')
if (( ${#SETTING_LINES[@]} == 0 )); then
  echo "nightly_local: SETTINGS has no settings string" >&2
  exit 2
fi
SHARD_IDS=()
if [[ -n "$SHARD_ONLY" ]]; then SHARD_IDS=("$SHARD_ONLY"); else mapfile -t SHARD_IDS < <(seq 1 "$SHARDS"); fi

CPUS="$(nproc 2>/dev/null || echo 2)"
RAY_ADDRESS="${RAY_ADDRESS:-}"
JOBS_GIVEN="${JOBS:-}"
if [[ -z "${JOBS:-}" ]]; then
  if [[ "$PARALLEL" == "1" ]]; then JOBS=$(( CPUS / (${#SHARD_IDS[@]} * ${#SETTING_LINES[@]}) )); else JOBS="$CPUS"; fi
  (( JOBS >= 1 )) || JOBS=1
fi

mkdir -p "$OUT"
# Fresh shard DBs each time: a stale shard from an earlier invocation must not leak into the merge.
if [[ "$STEPS" == "all" ]]; then rm -f "$OUT"/shard-*.db "$OUT"/shard-*.db-wal "$OUT"/shard-*.db-shm; fi
if [[ "$STEPS" != "shards" ]]; then
  rm -f "$OUT"/merged.db "$OUT"/merged.db-wal "$OUT"/merged.db-shm
  rm -f "$OUT"/baseline.txt "$OUT"/diff.txt "$OUT"/summary.md "$OUT"/headline.md
fi

# shard-<settings slug>-<i>.db: unique per (setting, shard), so CI jobs' DBs can land in one directory.
shard_db() {
  local slug
  slug="$(printf '%s' "${SETTING_LINES[$(($1 - 1))]}" | tr -c 'A-Za-z0-9=.+-' '_')"
  echo "$OUT/shard-${slug}-$2.db"
}

run_shard() {
  local k="$1" i="$2"
  local settings db
  read -r -a settings <<< "${SETTING_LINES[$((k - 1))]}"
  db="$(shard_db "$k" "$i")"
  rm -f "$db" "$db-wal" "$db-shm"
  local args=(run --list "$LIST" --target "$TARGET" "${settings[@]}" --shard "$i/$SHARDS" --db "$db" --quiet)
  if [[ -n "$RAY_ADDRESS" ]]; then
    args+=(--executor ray --ray-address "$RAY_ADDRESS")
    if [[ -n "$JOBS_GIVEN" ]]; then args+=(--jobs "$JOBS_GIVEN"); fi
  else
    args+=(--jobs "$JOBS")
  fi
  if [[ -n "$BACKEND" ]]; then args+=(--backend "$BACKEND"); fi
  if [[ -n "$LIMIT" ]]; then args+=(--limit "$LIMIT"); fi
  if [[ -n "$RERUN_FLAKY" ]]; then args+=(--rerun-flaky "$RERUN_FLAKY"); fi
  echo "== setting $k (${SETTING_LINES[$((k - 1))]}), shard $i/$SHARDS: $PORTHARNESS ${args[*]}" >&2
  # concurrent shards on one host: each its own simulated host (sim's devices take one process each)
  local host="${PORTHARNESS_SIM_NAMESPACE:-}"
  if [[ "$PARALLEL" == "1" ]]; then host="${host:-nightly-$$}-$k-$i"; fi
  # shellcheck disable=SC2086
  PORTHARNESS_SIM_NAMESPACE="$host" $PORTHARNESS "${args[@]}" > "${db%.db}.log" 2>&1 || {
    local rc=$?
    echo "setting $k shard $i failed (exit $rc); see ${db%.db}.log" >&2
    tail -20 "${db%.db}.log" >&2
    return "$rc"
  }
}

failed=0
bad_input=0
if [[ "$STEPS" != "night" ]]; then
  if [[ "$PARALLEL" == "1" ]]; then
    pids=()
    for k in $(seq 1 "${#SETTING_LINES[@]}"); do
      for i in "${SHARD_IDS[@]}"; do run_shard "$k" "$i" & pids+=("$!"); done
    done
    for pid in "${pids[@]}"; do wait "$pid" || { rc=$?; failed=1; if (( rc == 2 )); then bad_input=1; fi; }; done
  else
    for k in $(seq 1 "${#SETTING_LINES[@]}"); do
      for i in "${SHARD_IDS[@]}"; do run_shard "$k" "$i" || { rc=$?; failed=1; if (( rc == 2 )); then bad_input=1; fi; }; done
    done
  fi
  if (( bad_input )); then
    echo "nightly_local: a shard rejected its input (exit 2); see the shard logs" >&2
    exit 2
  fi
  if [[ "$STEPS" == "shards" ]]; then
    echo "nightly_local: shard DBs in $OUT" >&2
    exit "$failed"
  fi
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

# The gate: tonight against the committed expected outcomes (exit 1 on new failures or unexpected passes).
base_rc=0
if [[ "$NO_BASELINE" != "1" ]]; then
  if [[ "$UPDATE_BASELINE" == "1" ]]; then
    echo "== baseline update -> $EXPECTED_DIR" >&2
    mkdir -p "$EXPECTED_DIR"
    # shellcheck disable=SC2086
    $PORTHARNESS baseline update --db "$OUT/merged.db" --out-dir "$EXPECTED_DIR" >&2
  fi
  if [[ -n "$PROPOSED_DIR" ]]; then
    mkdir -p "$PROPOSED_DIR"
    # shellcheck disable=SC2086
    $PORTHARNESS baseline update --db "$OUT/merged.db" --out-dir "$PROPOSED_DIR" >&2
  fi
  echo "== baseline check against $EXPECTED_DIR" >&2
  check_args=(baseline check --db "$OUT/merged.db" --expected-dir "$EXPECTED_DIR" --perf-regression "$PERF_REGRESSION")
  if [[ -n "$FLAKY" ]]; then check_args+=(--flaky "$FLAKY"); fi
  if [[ -n "$PERF_ALLOWLIST" ]]; then check_args+=(--perf-allowlist "$PERF_ALLOWLIST"); fi
  set +e
  # shellcheck disable=SC2086
  $PORTHARNESS "${check_args[@]}" > "$OUT/baseline.txt" 2>&1
  base_rc=$?
  set -e
  cat "$OUT/baseline.txt"
fi

echo "== history -> $HISTORY" >&2
trend_args=(trend append --db "$OUT/merged.db" --history "$HISTORY" --summary "$OUT/headline.md")
if [[ -n "$NIGHT_DATE" ]]; then trend_args+=(--date "$NIGHT_DATE"); fi
mkdir -p "$(dirname "$HISTORY")"
# shellcheck disable=SC2086
$PORTHARNESS "${trend_args[@]}" >&2

echo "== report" >&2
report_args=(report --db "$OUT/merged.db" --out "$OUT/site" --night --history "$HISTORY")
if [[ -n "$PREV_DB" ]]; then report_args+=(--base-db "$PREV_DB"); fi
# shellcheck disable=SC2086
$PORTHARNESS "${report_args[@]}" >&2

rc=0
if [[ -n "$PREV_DB" ]]; then
  echo "== diff vs $PREV_DB" >&2
  diff_args=(diff --night --base-db "$PREV_DB" --head-db "$OUT/merged.db" --perf-regression "$PERF_REGRESSION")
  if [[ -n "$FLAKY_ALLOWLIST" ]]; then diff_args+=(--flaky-allowlist "$FLAKY_ALLOWLIST"); fi
  if [[ -n "$PERF_ALLOWLIST" ]]; then diff_args+=(--perf-allowlist "$PERF_ALLOWLIST"); fi
  set +e
  # shellcheck disable=SC2086
  $PORTHARNESS "${diff_args[@]}" | tee "$OUT/diff.txt"
  rc="${PIPESTATUS[0]}"
  set -e
else
  echo "== diff skipped (set PREV_DB=path/to/previous/merged.db to gate on regressions)" >&2
fi

# The job summary: the headline (ran % / matched % per configuration) and the verdicts first.
{
  echo "## portharness nightly: $LIST on $TARGET"
  echo
  cat "$OUT/headline.md"
  echo
  if [[ "$NO_BASELINE" == "1" ]]; then
    echo "**Baseline:** not checked"
  elif (( base_rc == 2 )); then
    echo "**Baseline: bad input** — $(tail -1 "$OUT/baseline.txt")"
  else
    echo "**Baseline:**"
    echo
    # one bullet per configuration: its expected file and the verdict
    awk '/^baseline check of run / { n = split($NF, p, "/"); file = p[n] }
         /^RESULT: / { sub(/^RESULT: /, ""); print "- `" file "`: " $0 }' "$OUT/baseline.txt"
  fi
  if [[ -n "$PREV_DB" ]]; then echo; echo "**Diff vs last night:** $(grep '^RESULT: ' "$OUT/diff.txt" | sed 's/^RESULT: //')"; fi
  if [[ -s "$OUT/baseline.txt" ]]; then
    echo; echo '<details><summary>baseline check</summary>'; echo; echo '```'; head -c 60000 "$OUT/baseline.txt"; echo '```'; echo '</details>'
  fi
} > "$OUT/summary.md"

echo "nightly_local: report at $OUT/site/index.html; merged DB at $OUT/merged.db; summary $OUT/summary.md" >&2
if (( failed )); then
  echo "nightly_local: at least one shard failed" >&2
  exit 1
fi
if (( base_rc == 2 || rc == 2 )); then exit 2; fi
if (( base_rc != 0 || rc != 0 )); then exit 1; fi
exit 0
