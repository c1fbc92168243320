"""Compiled and mixed-precision configurations of the target side: ``--compile BACKEND[:MODE]``,
``--dynamic`` and ``--amp DTYPE``.

A configuration changes how the target runs the step, never the reference side (the expected reference
follows the declared contract, `harness.backends.contracts`, which names the autocast dtype):

- compile: the target's model is compiled in place (``Module.compile``) with the backend as
  ``torch.compile`` would build it (Inductor and its modes, or any name registered with
  ``torch._dynamo``, a vendor's included), wrapped by a `Recorder` that keeps the graphs Dynamo hands
  it and, during the judged run, each graph's inputs, for the graph check (`harness.run.graphcheck`).
  Forward and, in train mode, the backward (AOTAutograd) are compiled; the optimizer steps run eagerly.
- amp: the step opens ``torch.autocast(<device type>, dtype)`` around its forward (and loss).

`CompileWatch` measures one model's compilation: a fresh Dynamo, the graphs it made, its graph breaks
(the first three reasons), recompiles, the compiler's wall time (Dynamo's compile callbacks, which also
cover a backward compiled lazily at its first call) apart from the run's, and whether Inductor's FX
graph cache served it (warm) or not (cold). While the compiler runs, the worker reports the phase
``compile``, which has its own deadline (``--compile-timeout``).

Compile caches: Inductor keeps its FX graph cache (generated code and compiled kernels, keyed by the
graph, the inputs' metadata, the compiler's configuration and torch's version) and AOTAutograd's under
one directory. A run uses ``<db>-compile-cache/<tag>`` (or ``--compile-cache DIR``/<tag>), where the tag
names the harness version and the backend's own code generator (`Adapter.compile_cache_tag`): Inductor's
key does not cover code generators registered from outside torch, so a changed one gets a fresh
directory instead of stale kernels. The cache is the harness's state: a compiled row that fails where the
cache may be the cause (`cache_suspect`: its error names a file there, or the cache served compiled code
that fails where eager passes) is compiled again in a fresh temporary cache before anyone is blamed, and
what a damaged entry was is dropped (`retry_in_fresh_cache`).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from harness import phases
from harness.backends.contracts import AMP_DTYPES
from harness.outcomes import PASSING
from harness.results.draft import RowDraft

KEYS = ("compile", "dynamic", "amp")  # settings keys a configuration adds to a run's identity
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
REASONS_KEPT = 3


@dataclass(frozen=True)
class Configuration:
    backend: str = ""  # a torch._dynamo backend name ("" = eager)
    compile_mode: str | None = None  # torch.compile's mode
    dynamic: bool | None = None
    amp: str = ""  # "bf16" / "fp16" ("" = no autocast)

    @classmethod
    def of(cls, settings: dict[str, Any]) -> Configuration:
        backend, _, mode = str(settings.get("compile", "")).partition(":")
        return cls(backend, mode or None, True if settings.get("dynamic") else None, settings.get("amp", ""))

    @property
    def compiled(self) -> bool:
        return bool(self.backend)

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return AMP_DTYPES[self.amp] if self.amp else None

    def eager(self) -> Configuration:
        return replace(self, backend="", compile_mode=None, dynamic=None)

    def label(self) -> str:
        return self.backend + (f" (mode {self.compile_mode})" if self.compile_mode else "") + (", dynamic" if self.dynamic else "")


def check(settings: dict[str, Any]) -> None:
    """ValueError naming the bad value and the choices (`--compile`, `--dynamic`, `--amp`)."""
    if "amp" in settings and settings["amp"] not in AMP_DTYPES:
        raise ValueError(f"--amp {settings['amp']!r}: expected one of {', '.join(AMP_DTYPES)}")
    if settings.get("dynamic") and "compile" not in settings:
        raise ValueError("--dynamic: only with --compile BACKEND (it is torch.compile's dynamic=True)")
    if "compile" not in settings:
        return
    backend, _, mode = str(settings["compile"]).partition(":")
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"--compile {settings['compile']!r}: {backend!r} is not a torch._dynamo backend; known: "
                         f"{', '.join(known)} (a vendor's registers itself when its module is imported: --backend MODULE)")
    if mode and mode not in COMPILE_MODES:
        raise ValueError(f"--compile {settings['compile']!r}: mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if mode and backend != "inductor":
        raise ValueError(f"--compile {settings['compile']!r}: a mode is Inductor's (torch.compile passes it to no other backend)")


def cache_dir(base: str, tag: str) -> str:
    """Where one run's compile caches live: `base`, under the harness version and the backend's tag."""
    from harness import __version__

    return os.path.join(base, "-".join(x for x in (f"portharness-{__version__}", tag) if x))


# -- the compile cache, and a failure it may have caused --------------------------------------------------

RETRIED = ("compile_fail", "crash", "drift")  # what a damaged cached kernel or module makes of a good model


def cache_suspect(directory: str, fields: Mapping[str, Any], eager_outcome: str) -> bool:
    """Whether the run's compile cache at `directory` may have caused the failed compiled row `fields`: its
    error names a file there (a truncated kernel, a module that does not load), or the cache served the
    compiled code (warm, mixed) and the same step passes eagerly on the same device."""
    if not directory or fields.get("outcome") not in RETRIED or fields.get("device_fault"):
        return False
    named = any(d in _error_text(fields) for d in _spellings(directory))
    return named or (fields.get("compile_cache") in ("warm", "mixed") and eager_outcome in PASSING)


def _error_text(fields: Mapping[str, Any]) -> str:
    return f"{fields.get('error_message') or ''}\n{fields.get('traceback') or ''}"


def _spellings(directory: str) -> set[str]:
    return {directory, os.path.abspath(directory), os.path.realpath(directory)}


def _named_files(directory: str, fields: Mapping[str, Any]) -> list[Path]:
    """The files inside `directory` that the failure's message or traceback names (a module that does not
    load, a kernel that does not build): generated modules are named by a digest of code that holds the
    cache's own path, so a compile into another directory names them differently."""
    text = _error_text(fields)
    found = set()
    for d in _spellings(directory):
        for m in re.finditer(re.escape(d.rstrip(os.sep) + os.sep) + r"[^\s'\",:;()\[\]]+", text):
            found.add(Path(m.group(0)))
    return sorted(found)


def retry_in_fresh_cache(directory: str, failed: Mapping[str, Any], eager_outcome: str,
                         attempt: Callable[[str], RowDraft]) -> RowDraft | None:
    """`attempt(cache)` (the compiled step, its row fields) again in a fresh temporary cache when the run's
    own cache at `directory` may have caused `failed` (`cache_suspect`); None when it may not have.

    The compile cache is the harness's state, not the backend's: an outcome that changes in a fresh cache
    was the cache's doing, so the row is the fresh run's (``compile_cache`` "rebuilt") and what the fresh
    compile made is dropped from `directory` (the next run compiles it anew instead of loading the damaged
    copy). The same outcome again is the compiler's or the device's, and the row says it was checked."""
    if not cache_suspect(directory, failed, eager_outcome):
        return None
    _forget_probes()
    with tempfile.TemporaryDirectory(prefix="portharness-compile-") as fresh:
        again = attempt(fresh)
        if again.get("outcome") == failed.get("outcome"):
            note = "the same in a fresh compile cache: not the cache's"
            again["error_message"] = (f"{again['error_message']}; {note}" if again.get("error_message") else note)[:2000]
            return again
        drop_entries(directory, fresh, also=_named_files(directory, failed))
    again["compile_cache"] = "rebuilt"
    return again


def drop_entries(directory: str, fresh: str, also: Iterable[Path] = ()) -> int:
    """Remove from the cache `directory` what a compile into the empty cache `fresh` made (kernels, modules
    and probe libraries by name; FX graph and AOTAutograd entries by key, every entry of the key) and the
    files `also` names: a damaged copy is among them. Returns the paths removed; one that cannot be is left
    (it is retried)."""
    from harness import files

    shared, new = Path(directory), Path(fresh)
    targets: set[Path] = {p for p in also if p.is_file()}
    for f in new.rglob("*"):
        rel = f.relative_to(new)
        if f.is_file() and rel.parts[0] != "locks":
            keyed = rel.parts[0] in ("fxgraph", "aotautograd") and len(rel.parts) >= 3
            targets.add(shared / (rel.parent if keyed else rel))
    gone = 0
    for path in sorted(targets):
        with contextlib.suppress(OSError, files.OutputError):
            if path.is_dir():
                gone += files.remove_dir(path)
            elif path.exists():
                path.unlink()
                gone += 1
    return gone


def _forget_probes() -> None:
    """Inductor probes the machine's vector ISA once per process, by building and loading a small library in
    the cache; one a damaged library failed would leave every later compile without (or at odds with) it."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return
    cached = [getattr(cpu_vec_isa, "valid_vec_isa_list", None)]
    todo = [getattr(cpu_vec_isa, "VecISA", object)]
    while todo:  # each ISA class memoizes its own check (`__bool__`, its base's `__bool__impl`)
        cls = todo.pop()
        todo += cls.__subclasses__()
        cached += vars(cls).values()
    for fn in cached:
        clear = getattr(fn, "cache_clear", None)
        if callable(clear):
            clear()


@contextlib.contextmanager
def compile_cache(directory: str) -> Iterator[None]:
    """Inductor's and AOTAutograd's caches in `directory` while the target runs ("" = torch's default)."""
    if not directory:
        yield
        return
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    os.makedirs(directory, exist_ok=True)
    with temporary_cache_dir(directory):
        yield


# -- the backend, recorded ----------------------------------------------------------------------


@dataclass
class Graph:
    """One graph Dynamo compiled, and its inputs at the first call of the judged run."""

    gm: torch.fx.GraphModule
    args: list[Any] | None = None


class Recorder:
    """The configured backend as ``torch.compile`` builds it, keeping what the graph check needs."""

    def __init__(self, cfg: Configuration) -> None:
        self.cfg = cfg
        if cfg.backend == "inductor":
            self.inner = torch._TorchCompileInductorWrapper(cfg.compile_mode, None, cfg.dynamic)
        else:
            self.inner = torch._TorchCompileWrapper(cfg.backend, cfg.compile_mode, None, cfg.dynamic)
        self.__name__ = cfg.backend  # how Dynamo names the backend in its errors
        self.graphs: list[Graph] = []
        self.capturing = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graph = torch.fx.Graph()
        out = graph.graph_copy(gm.graph, {})
        graph.output(out)
        entry = Graph(torch.fx.GraphModule(gm, graph))  # before the backend's passes rewrite gm
        self.graphs.append(entry)
        compiled = self.inner(gm, example_inputs)

        def run(*args: Any) -> Any:
            if self.capturing and entry.args is None:
                entry.args = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            return compiled(*args)

        return run

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()


def compile_model(model: torch.nn.Module, cfg: Configuration) -> Recorder:
    """Compile `model` in place (its parameters keep their names: train mode reads them)."""
    recorder = Recorder(cfg)
    model.compile(backend=recorder, dynamic=cfg.dynamic)
    return recorder


# -- what compiling cost and made ---------------------------------------------------------------


@dataclass
class CompileWatch:
    """Counters of one model's compilation (see the module docstring); `fields()` gives the row's."""

    on_phase: Callable[[str], None] | None = None  # tells the supervisor "compile" while the compiler runs
    phase_now: Callable[[], str] = lambda: "target"  # the phase to report when it is done
    seconds: float = 0.0
    spans: int = 0
    _t0: float | None = field(default=None, repr=False)
    _frozen: RowDraft | None = field(default=None, repr=False)

    def __enter__(self) -> CompileWatch:
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.utils import clear_compilation_metrics, counters

        torch._dynamo.reset()  # one model's graphs, guards and counters only
        counters.clear()
        clear_compilation_metrics()
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)

    def _start(self, _args: Any) -> None:
        self._t0 = time.perf_counter()
        if self.on_phase is not None:
            self.on_phase(phases.COMPILE.name)

    def _end(self, _args: Any) -> None:
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.spans += 1
            self._t0 = None
        if self.on_phase is not None:
            self.on_phase(self.phase_now())

    def freeze(self) -> RowDraft:
        """The fields as of now (later compiles, the graph check's own, are not the model's)."""
        self._frozen = self.fields()
        return self._frozen

    def fields(self) -> RowDraft:
        if self._frozen is not None:
            return self._frozen
        from torch._dynamo.utils import counters, get_compilation_metrics

        breaks = counters["graph_break"]
        hits = counters["inductor"]["fxgraph_cache_hit"]
        misses = counters["inductor"]["fxgraph_cache_miss"]
        return RowDraft(
            graph_count=int(counters["stats"]["unique_graphs"]),
            graph_breaks=int(sum(breaks.values())),
            graph_break_reasons=[_reason(r) for r in list(breaks)[:REASONS_KEPT]],
            recompiles=sum(1 for m in get_compilation_metrics() if m.recompile_reason),
            compile_s=round(self.seconds, 3) if self.spans else None,
            compile_cache="warm" if hits and not misses else "cold" if misses and not hits else "mixed" if hits else "",
        )


def _reason(text: str) -> str:
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    return " ".join(lines[:3])[:300]


@contextlib.contextmanager
def compiling(cfg: Configuration, cache: str, announce: Callable[[str], None],
              current: Callable[[], str]) -> Iterator[CompileWatch | None]:
    """What a run of the target under `cfg` happens inside: compiled, its compile cache and a watch counting
    the compilation (announced through `announce`, the phase read with `current`); eager, nothing."""
    if not cfg.compiled:
        yield None
        return
    with compile_cache(cache):
        yield CompileWatch(announce, current)
