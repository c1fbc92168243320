"""Every `portharness` option, defined once: the parser and its subcommands (each names its `cmd_*`)."""

from __future__ import annotations

import argparse
import functools
import os
import shlex
from pathlib import Path
from typing import Any, NoReturn

from harness.cli.cache import cmd_cache
from harness.cli.collectives import cmd_collectives
from harness.cli.ops import cmd_ops
from harness.cli.placement import cmd_placement
from harness.cli.results import (
    cmd_baseline,
    cmd_diff,
    cmd_groups,
    cmd_matrix,
    cmd_merge,
    cmd_report,
    cmd_trend,
)
from harness.cli.runs import cmd_check, cmd_run, cmd_zoo
from harness.fleet.executor import EXECUTORS
from harness.models.heads import HEADS
from harness.run import KV_CACHES, MODE_NAMES, NEW_TOKENS

DEFAULT_DB = "results/portharness.db"


def _version() -> str:
    """portharness's version with the torch and transformers it runs on (read without importing them)."""
    from harness.results.rows import versions

    v = versions()
    return (f"portharness {v['harness_version']} (torch {v['torch_version'] or 'not installed'}, "
            f"transformers {v['transformers_version'] or 'not installed'})")


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line, as every other bad input is (`--help` stays whole).
    Subcommands' parsers are of the same class (argparse makes them with ``type(parent)``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def _target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="sim", help="device to test: sim, sim:1, cuda, xpu, cpu, ... (default sim)")
    p.add_argument(
        "--precision",
        default="default",
        help="sim: default (bf16 matmul inputs) or highest; other targets: torch float32 matmul precision",
    )
    p.add_argument("--ops", default=None, help="sim op profile: young (default), full, or a profile file")
    p.add_argument("--attn", default=None, choices=["eager", "sdpa", "flex_attention"],
                   help="force an attention implementation (flex_attention reproduces the classic coverage gap)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per model after loading before its worker is killed (default 300)")
    p.add_argument("--load-timeout", type=float, default=900.0,
                   help="seconds a model may take to load (its own budget: real checkpoints load slowly; default 900)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16", "auto"],
                   help="load weights as fp32 (default: the reference is fp32), bf16, fp16, or auto "
                        "(the checkpoint's torch_dtype)")
    p.add_argument("--oracle-max-params", type=int, default=None, metavar="N",
                   help="largest model judged against an fp64 oracle (beyond: the cosine/allclose fallback; default "
                        "20e9 parameters: a float64 copy up to 50M, a streamed upcast above)")
    p.add_argument("--mem-cap-mb", type=int, default=8192,
                   help="extra memory a worker may take, in MiB (0 = no cap; default 8192)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the model's weights, inputs and labels (default 0; another seed is another run "
                        "identity)")
    p.add_argument("--fault", default=None,
                   help="inject sim faults, e.g. 'sim:1=nan:1.0' (sets PORTHARNESS_SIM_FAULTS for the workers)")
    p.add_argument("--no-localize", action="store_true", help="skip the per-module drift localization")
    p.add_argument("--declared-precision", default=None, metavar="CONTRACT",
                   help="numerics contract the target declares: fp32 (default for other backends), tf32, bf16-matmul, "
                        "fp16-matmul; sim declares bf16-matmul at --precision default, fp32 at highest")
    p.add_argument("--confirm", default="on", choices=["on", "off"],
                   help="a pass within the declared precision only (pass_declared) runs once more at the device's "
                        "highest precision, judged by the fp32 rule: a bug the declared rounding hid is a drift "
                        "(default on; off: skip it, part of the run's identity)")
    p.add_argument("--numerics-bug", dest="numerics", default=None, metavar="KINDS",
                   help="sim: plant quiet kernel bugs (bf16-accumulate, softmax-no-max, approx-exp, gelu-mixup, "
                        "grad-scale, cache-off-by-one; comma-separated) to see the verdict catch them")
    p.add_argument("--mode", default=MODE_NAMES[0], choices=MODE_NAMES,
                   help="inference: one forward, outputs compared; train: one training step (loss, every gradient, "
                        "the SGD-momentum and AdamW updates) compared; generate: greedy decoding with a KV cache, "
                        "each step's logits compared along the reference's tokens (models that cannot generate: "
                        "skipped)")
    p.add_argument("--new-tokens", type=int, default=None, metavar="N",
                   help=f"--mode generate: tokens to decode (default {NEW_TOKENS})")
    p.add_argument("--cache", default=None, choices=KV_CACHES,
                   help="--mode generate: transformers' DynamicCache (default) or StaticCache (preallocated, written "
                        "in place: the path compiled decoders use)")
    p.add_argument("--op-check", default="auto", choices=["auto", "all", "sampled", "off"],
                   help="kernel-conformance check (each op judged on its own inputs against the CPU): every call "
                        "(all), the first calls of each op signature (sampled), or none; auto = all up to 50M "
                        "parameters, sampled above")
    p.add_argument("--no-op-check", dest="op_check", action="store_const", const="off", help="same as --op-check off")
    p.add_argument("--fallback", default=None, choices=["off", "cpu"],
                   help="sim: run ops outside the op profile on the host and count them (cpu) instead of failing")
    p.add_argument("--slow-ops", dest="slow_ops", default=None, metavar="SPEC",
                   help="sim, with --perf: plant slowdowns, e.g. 'aten::softmax:3' (that kernel 3x slower, 1 to 1000; "
                        "comma-separated) to see the speed gate catch them")
    p.add_argument("--perf", action="store_true",
                   help="after the verdict, time the step on the target and the CPU reference (interleaved, "
                        "synchronized), profile the target's ops, record the device's peak memory")
    p.add_argument("--perf-budget", dest="perf_budget", type=float, default=None, metavar="SECONDS",
                   help="with --perf: at most SECONDS of timed rounds per model, after warm-up (default 1; at least "
                        "5 rounds; fewer seconds once the compared ratio's interval is tight)")
    p.add_argument("--parallel", default=None, metavar="SPEC",
                   help="spread each model over several devices, one process per device: ddp:N, fsdp:N (FSDP2), "
                        "tp:N (the model's tensor-parallel plan) or fsdp:N,tp:M; every rank fed the whole batch, the "
                        "outputs (and gradients) judged against the single-device CPU reference (part of the run's "
                        "identity)")
    p.add_argument("--collectives", default=None, metavar="SETTINGS",
                   help="with --parallel --perf: time each model's parallel step under each collective setting, "
                        "interleaved (comma-separated, the first the baseline; sim: fused, skinny[:PIECE], "
                        "bucket:SIZE, cap:SIZE, per-host[:N], joined by '+')")
    p.add_argument("--dist-backend", dest="dist_backend", default=None, metavar="NAME",
                   help="with --parallel: the c10d backend of the target's process groups (default: the one its "
                        "backend registered for the device type, e.g. sim's, nccl for cuda, gloo for cpu)")
    _config_options(p)
    _backend_option(p)


def _fleet_options(p: argparse.ArgumentParser, what: str) -> None:
    """How a list's jobs (models, or op variations) run: workers, executor, shards, resume, the policy."""
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes (default: one per CPU core); with --executor ray: actors (default: one "
                        "per device of the cluster)")
    p.add_argument("--executor", default="local", choices=list(EXECUTORS),
                   help="local: worker processes on this host (default); ray: one actor per device of every node of "
                        "a Ray cluster (pip install 'portharness[ray]')")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="with --executor ray: auto (the cluster `ray start` made on this host), HOST:PORT (its "
                        "head), ray://HOST:PORT (Ray Client); default: a Ray instance of this host alone")
    p.add_argument("--shard", default="1/1", help=f"run shard i of N (i/N) of the {what}")
    p.add_argument("--db", default=DEFAULT_DB, help=f"result DB (default {DEFAULT_DB})")
    p.add_argument("--resume", action="store_true", help="continue the latest unfinished matching run")
    p.add_argument("--limit", type=int, default=0, help=f"only the first N {what} (after sharding)")
    p.add_argument("--retries", type=int, default=1, help="retries for crashes/timeouts/device errors")
    p.add_argument("--spare", type=int, default=0, help="devices kept idle as hot spares")
    p.add_argument("--quarantine-after", type=int, default=2, help="device strikes before quarantine")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")


def _ref_cache_options(p: argparse.ArgumentParser, default: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ref-cache", default=None, metavar="DIR",
                   help="reference cache: each model's fp32 reference, fp64 oracle and expected reference (and train "
                        "mode's step), reused until anything they depend on changes (model, config, inputs, seed, "
                        "mode, dtype, contract, versions); shards and hosts can share one on a common file system "
                        f"({default})")
    g.add_argument("--no-ref-cache", action="store_true", help="compute the reference side every time; store nothing")


def _config_options(p: argparse.ArgumentParser) -> None:
    """Compiled and mixed-precision configurations of the target (harness.run.compiled)."""
    p.add_argument("--compile", default=None, metavar="BACKEND[:MODE]",
                   help="run the target compiled: torch.compile with this torch._dynamo backend (inductor, aot_eager, "
                        "eager, or a vendor's) and Inductor mode (e.g. inductor:max-autotune); the reference is unchanged")
    p.add_argument("--dynamic", action="store_true", help="with --compile: torch.compile(dynamic=True)")
    p.add_argument("--amp", default=None, choices=["bf16", "fp16"],
                   help="run the target's step under torch.autocast(<device>, dtype); the expected reference under "
                        "torch.autocast('cpu', dtype) (contracts amp-bf16, amp-fp16); fp16 training scales the loss")
    p.add_argument("--compile-timeout", type=float, default=None, metavar="SECONDS",
                   help="with --compile: seconds the compiler may run for one model (its own budget, apart from "
                        "--timeout; default 600)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="with --compile: Inductor's FX graph and AOTAutograd caches (default: <db>-compile-cache/ next to the DB; "
                        "~/.cache/portharness/compile-cache for check without --db)")
    p.add_argument("--compiler-bug", dest="compiler_bug", default=None, metavar="KIND",
                   help="sim: plant a compiler-only bug in Inductor's generated code (erf-tanh), with --compile inductor")


def _backend_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", default=[], metavar="MODULE",
                   help="import MODULE to register the target's backend (repeatable; also PORTHARNESS_BACKENDS="
                        "mod1,mod2); entry-point backends load by themselves")
    p.add_argument("--backend-timeout", type=float, default=None, metavar="SECONDS",
                   help="deadline for importing the --backend modules (default 120; they are imported in a child "
                        "process first, so one that exits, crashes or hangs is named instead of taking the command down)")


def _perf_gate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--perf-regression", type=float, default=1.2, metavar="FACTOR",
                   help="models timed with --perf on both sides: a slowdown of at least FACTOR whose 95%% interval "
                        "(both runs' own noise) is above 1 is a perf regression (default 1.2)")
    p.add_argument("--perf-allowlist", default=None, metavar="FILE",
                   help="known-noisy models whose perf regressions are reported but do not gate: "
                        "'model-id-or-pattern  # why' per line")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="portharness",
                description="Backend-portability and numerical-conformance harness for PyTorch accelerators.")
    ap.add_argument("--version", action="version", version=_version())
    # how a row's check command is spelled travels with the arguments: the commands need not import this module
    ap.set_defaults(check_command=check_command, flag_of=flag)  # handed to the commands, which import no options
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="run one model on reference and target; exit 0 on pass / pass_declared (or skipped: "
                       "the mode does not apply to the model)")
    p.add_argument("model", help="model id: tiny/<arch>/<head>, a hub id, or a local save_pretrained dir")
    _target_options(p)
    p.add_argument("--task", default=None, choices=sorted(HEADS), metavar="TASK",
                   help="head to load a local or hub checkpoint with (default: the one it was saved with, from "
                        "its config's architectures; base for hub ids)")
    p.add_argument("--json", action="store_true", help="print the full result row as JSON")
    p.add_argument("--db", default=None, help="also record the row in this result DB")
    _ref_cache_options(p, "default: ref-cache/ next to --db; none without --db")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("run", help="run a model list on a target, recording every outcome")
    p.add_argument("--list", default="tiny-zoo", help="model list name (model_lists/NAME.csv) or path")
    _target_options(p)
    _fleet_options(p, "models")
    p.add_argument("--only", default="", help="comma-separated model ids or architectures to run")
    p.add_argument("--rerun-flaky", type=int, default=0, metavar="N",
                   help="re-run each model whose attempts disagreed N more times; flaky only if it really flips")
    p.add_argument("--report", default=None, help="build the HTML report into this directory afterwards")
    p.add_argument("--harvest", action="store_true",
                   help="also record each model's op calls as variations (for `portharness ops`): the reference step "
                        "once more on the CPU, under a recording dispatch mode")
    _ref_cache_options(p, "default: ref-cache/ next to --db")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("ops", help="the kernel worklist: every op variation the list's models use, run alone on the "
                       "target and judged against the CPU; ops ranked by the models they block or explain")
    p.add_argument("action", nargs="?", default="run", choices=["run", "harvest"],
                   help="run (default): harvest what is missing, then run the variations; harvest: only record "
                        "the list's op variations (the load and the reference step on the CPU)")
    p.add_argument("--list", default="tiny-zoo", help="model list name (model_lists/NAME.csv) or path")
    _target_options(p)
    p.set_defaults(timeout=60.0)  # one kernel: a minute is a hang
    _fleet_options(p, "variations")
    p.add_argument("--source", default="models", choices=["models", "opinfo"],
                   help="models (default): the variations the list's models call; opinfo: PyTorch's OpInfo samples "
                        "of the ops they call (empty, non-contiguous, broadcast, extreme values, integer dtypes)")
    p.add_argument("--opinfo-samples", type=int, default=8, metavar="N",
                   help="--source opinfo: samples per OpInfo and dtype (default 8)")
    p.add_argument("--only", default="", metavar="OPS",
                   help="comma-separated ops (gelu, aten::sort.stable, aten::addmm.default) or variation ids to run")
    p.set_defaults(func=cmd_ops)

    p = sub.add_parser("matrix", help="models x (target, settings) outcome matrix, ran %% and matched %%")
    p.add_argument("--db", default=DEFAULT_DB, help=f"result DB (default {DEFAULT_DB})")
    p.add_argument("--run", default=None, help="run id (default: latest)")
    p.add_argument("--by", choices=["arch", "task", "modality"], default=None,
                   help="also print ran %% and numerics matched %% by this")
    p.add_argument("--ops", action="store_true",
                   help="rank missing ops by models they would unblock, and the op worklist of this configuration's "
                        "op run (portharness ops): each failing variation with the models it blocks or explains")
    p.add_argument("--ops-limit", type=int, default=10, metavar="N", help="with --ops: ops in 'what to fix first'")
    p.add_argument("--opinfo", default=None, help="OpInfo conformance CSV to join into the op ranking")
    p.add_argument("--perf", action="store_true",
                   help="print the speed of every model timed with --perf instead of the outcome matrix (and export "
                        "it with --out)")
    p.add_argument("--out", default=None, help="export the matrix (.csv, .json, .parquet)")
    p.set_defaults(func=cmd_matrix)

    p = sub.add_parser("diff", help="compare two runs; exit 1 on regressions (CI gate)")
    p.add_argument("--db", default=None, help="DB holding both runs (or the head run with --base-db)")
    p.add_argument("--base", default=None, help="base run id (default: previous comparable run)")
    p.add_argument("--head", default=None, help="head run id (default: latest run)")
    p.add_argument("--base-db", default=None, help="DB of the base run (its latest run)")
    p.add_argument("--head-db", default=None, help="DB of the head run (its latest run)")
    p.add_argument("--drift-factor", type=float, default=2.0,
                   help="rmse-ratio growth counted as a regression (default 2.0: twice the base run's ratio)")
    p.add_argument("--flaky-allowlist", default=None, help="file of model ids known to be flaky")
    p.add_argument("--night", action="store_true",
                   help="with --base-db/--head-db: compare every configuration's latest run (merged nightly DBs)")
    _perf_gate_options(p)
    p.add_argument("--json", action="store_true", help="print the diff as JSON")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("report", help="build the static HTML report")
    p.add_argument("--db", default=DEFAULT_DB, help=f"result DB (default {DEFAULT_DB})")
    p.add_argument("--out", default="reports/site",
                   help="directory of the site, rebuilt in place (default reports/site); open its index.html")
    p.add_argument("--run", default=None, help="run id (default: latest)")
    p.add_argument("--base", default=None, help="base run for the diff page")
    p.add_argument("--base-db", default=None, help="previous night's DB for the diff page")
    p.add_argument("--opinfo", default=None, help="OpInfo conformance CSV (scripts/opinfo_table.py)")
    p.add_argument("--history", default=None, help="nightly history file (portharness trend append): adds the trend page")
    p.add_argument("--night", action="store_true",
                   help="show the latest run of every configuration in the DB (a merged nightly DB with several settings)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("merge", help="merge shard DBs into one")
    p.add_argument("--out", required=True, help="destination DB (created if missing)")
    p.add_argument("dbs", nargs="+", help="shard DBs to merge")
    p.add_argument("--no-combine", action="store_true", help="keep per-shard runs separate")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("collectives", help="benchmark collective settings on the target")
    p.add_argument("--target", default="sim", help="sim, cpu (gloo) or cuda (nccl)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--sizes", default=None, help="comma-separated byte counts, k/m suffixes allowed (default 4k,64k,1m,16m)")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per size and setting (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repeats first (default 2)")
    p.add_argument("--settings", default=None, help="comma-separated setting names (fused, skinny[:N], bucket:N, "
                   "cap:N, per-device, per-host[:k]; default fused,skinny,bucket:256k,cap:256k,per-host)")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the DDP training-step benchmark")
    _backend_option(p)
    p.add_argument("--db", default=None, help="record rows in this result DB")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds; with --faults: the detection budget (default 10; the collective timeout is half, "
                   "the stall watchdog a fifth); else the collective timeout (default 300)")
    g = p.add_argument_group("fault scenarios (one bad rank in a DDP job; exit 1 if one goes undetected or unnamed)")
    g.add_argument("--faults", default=None,
                   help="run these scenarios instead of timing settings: comma-separated hang, slow[:F], nan, die, "
                   "flap[:F], none, or all (default settings: fused)")
    g.add_argument("--fault-rank", type=int, default=1, help="the bad rank (default 1)")
    g.add_argument("--fault-step", type=int, default=5, help="the step it goes bad at (default 5)")
    g.add_argument("--steps", type=int, default=20, help="training steps per scenario (default 20)")
    g.add_argument("--spare", type=int, default=0, help="hot spare ranks: a die/hang recovers onto one (default 0)")
    g.add_argument("--straggler-excess", type=float, default=None,
                   help="straggler bar above the peers' mean (default 0.1 on cuda, 0.5 where ranks share cores)")
    p.set_defaults(func=cmd_collectives)

    p = sub.add_parser("placement", help="which placements of processes on the target's chips it allows (one "
                       "process per chip, one for all, K on one chip, an RL trainer and generator on one) and what "
                       "each costs; exit 1 if a process hangs or fails, or numbers move")
    p.add_argument("--target", default="sim", help="device: sim, sim:1, cpu, cuda, ... (shared:K and rl use this one; "
                   "per-chip and host every device of its type; sim's devices are exclusive unless "
                   "PORTHARNESS_SIM_SHARING=shared)")
    p.add_argument("--scenarios", default="per-chip,host,shared:2,rl",
                   help="comma-separated: per-chip, host, shared:K (K processes on one device, 2 to 16), rl, or all "
                        "(default per-chip,host,shared:2,rl)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per process and phase (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per scenario, its processes' start included; past it the processes that have "
                        "not answered are named and every one is killed (default 300)")
    _backend_option(p)
    p.add_argument("--db", default=None, help="record one row per scenario in this result DB")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_placement)

    p = sub.add_parser("zoo", help="regenerate the tiny-zoo list from the installed transformers")
    zoo_csv = Path(__file__).resolve().parents[1] / "model_lists" / "tiny-zoo.csv"
    p.add_argument("--out", default=str(zoo_csv), help=f"the list to write (default {zoo_csv})")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)),
                   help="worker processes (default: one per CPU core)")
    p.add_argument("--limit", type=int, default=None, help="only the first N candidates (for a quick look)")
    p.add_argument("--only", default=None, help="comma-separated model types or type/task pairs")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per candidate (default 120)")
    p.add_argument("--report", default=None, help="write every candidate's result as JSON here")
    p.set_defaults(func=cmd_zoo)
    _nightly_parsers(sub)
    _cache_parsers(sub)
    return ap


def _cache_parsers(sub: Any) -> None:
    """`cache stats` and `cache prune`: the reference cache `check` and `run` keep."""
    p = sub.add_parser("cache", help="the reference cache: what it holds (stats), what to drop (prune)")
    p.set_defaults(func=cmd_cache)
    c = p.add_subparsers(dest="cache_command", required=True)
    stats = c.add_parser("stats", help="entries, size, last use, by versions and mode")
    prune = c.add_parser("prune", help="remove entries unused for a while, or the least recently used beyond a size")
    for q in (stats, prune):
        q.add_argument("--ref-cache", default=None, metavar="DIR", help="the cache (default: ref-cache/ next to --db)")
        q.add_argument("--db", default=DEFAULT_DB, help=f"the result DB the cache sits next to (default {DEFAULT_DB})")
        q.add_argument("--json", action="store_true", help="print the answer as JSON")
    prune.add_argument("--older-than", default=None, metavar="AGE",
                       help="remove entries not used for AGE: a number with s, m, h, d or w (30d, 12h)")
    prune.add_argument("--max-size", default=None, metavar="SIZE",
                       help="then remove the least recently used entries until the rest fit in SIZE: bytes, or a "
                            "number with K, M, G or T (powers of 1024: 20G, 500M)")
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")


def _nightly_parsers(sub: Any) -> None:
    """`baseline`, `trend` and `groups`: what a nightly job gates on and keeps."""
    p = sub.add_parser("baseline", help="expected outcomes per configuration: write them, check a run against them")
    p.set_defaults(func=cmd_baseline)
    b = p.add_subparsers(dest="baseline_command", required=True)
    p = b.add_parser("update", help="write the expected file(s) from a run")
    p.add_argument("--db", required=True, help="result DB of the run (a merged nightly DB: every configuration)")
    p.add_argument("--run", help="run id (default: the DB's run, or the one --out is named for)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="expected file, e.g. model_lists/expected/<list>--<target>--<settings>.csv")
    g.add_argument("--out-dir", help="write one conventionally named file per configuration in the DB")
    p = b.add_parser("check", help="classify a run against its expected file; exit 1 on new failures or unexpected passes")
    p.add_argument("--db", required=True, help="result DB of the run to check (a merged nightly DB: every configuration)")
    p.add_argument("--run", help="run id (default: the latest run of the file's configuration)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--expected", help="expected file")
    g.add_argument("--expected-dir", help="check every configuration in the DB against its file here")
    p.add_argument("--flaky", help="flaky list: 'model-or-pattern  # reason' per line")
    _perf_gate_options(p)
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")

    p = sub.add_parser("trend", help="nightly history: append a night's summary, show the trend")
    p.set_defaults(func=cmd_trend)
    t = p.add_subparsers(dest="trend_command", required=True)
    p = t.add_parser("append", help="append the DB's night (latest run per configuration) to the history file")
    p.add_argument("--db", required=True, help="result DB of the night (a merged nightly DB: every configuration)")
    p.add_argument("--history", required=True, help="history file (JSON lines; created on the first night)")
    p.add_argument("--date", help="the night's date (default: each run's start date)")
    p.add_argument("--summary", help="also write the night's headline as a Markdown table here")
    p = t.add_parser("show", help="print the trend per configuration")
    p.add_argument("--history", required=True, help="history file (JSON lines, from trend append)")
    p.add_argument("--json", action="store_true", help="print the history as JSON")

    p = sub.add_parser("groups", help="failures grouped by fingerprint (outcome, op or module type, error line)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"result DB (default {DEFAULT_DB})")
    p.add_argument("--run", help="run id (default: latest)")
    p.add_argument("--limit", type=int, default=30, help="groups to print (default 30)")
    p.add_argument("--json", action="store_true", help="print every group as JSON")
    p.set_defaults(func=cmd_groups)



@functools.cache
def _check_options() -> dict[str, argparse.Action]:
    """`check`'s options by destination (a run's settings are keyed by them), the first spelling of each."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out: dict[str, argparse.Action] = {}
    for action in sub.choices["check"]._actions:
        if action.option_strings:
            out.setdefault(action.dest, action)
    return out


def flag(key: str) -> str:
    """The option that sets setting `key` (``numerics`` -> ``--numerics-bug``)."""
    action = _check_options().get(key)
    return action.option_strings[0] if action is not None else f"--{key.replace('_', '-')}"


def check_command(model_id: str, target: str, settings: dict[str, Any]) -> str:
    """The `portharness check` command line that reproduces one row: its model, target and settings, each
    setting spelled as the option that set it (values equal to the option's default left out)."""
    parts = ["portharness", "check", model_id, "--target", target]
    options = _check_options()
    for key, value in sorted((settings or {}).items()):
        action = options.get(key)
        if action is not None and action.nargs == 0:  # a switch (--dynamic)
            parts += [flag(key)] if value and value != action.default else []
        elif action is None or str(value) != str(action.default):
            parts += [flag(key), str(value)]
    return " ".join(shlex.quote(p) for p in parts)
