"""sim's native backend (``csrc/``): built on first use, cached, loaded in every process.

sim is a PrivateUse1 backend in C++, as a real one is: its tensors are plain `torch.Tensor`s with
dispatch key PrivateUse1 and storage from sim's `c10::DeviceAllocator` (host memory, counted per
simulated device), and one boxed kernel serves every op (``csrc/kernel.cpp``; ``csrc/dispatch.h``
maps the other files, one per concept). What only C++ can give: a device guard that knows more than one device (torch's Python guard hard-codes one, and the
autograd engine sizes its per-device queues from it), the allocator that ``torch.accelerator``'s
memory API wants, a dispatch path that costs no Python call per op, and a c10d ``Backend`` (torch
cannot make one in Python, and only a group with one has the name DeviceMesh looks it up by). Python is
called back only where a switch needs it (an injected fault) and to plan each collective; planted
numerics bugs and autocast register their own kernels.

Build: `torch.utils.cpp_extension` supplies the compiler (``$CXX`` or ``c++``), include and library
paths and pybind11's ABI flags. The sources compile in parallel, then link. The library lands in
``$TORCH_EXTENSIONS_DIR`` (default: torch's extension cache, ``~/.cache/torch_extensions``) under
``portharness_sim/<hash>/``, the hash covering the sources, torch and Python versions and the flags, so
worktrees and upgrades never share a stale build. An exclusive file lock makes concurrent first
imports (pytest-xdist workers, spawned ranks) build once; the others wait and load the result. Later
imports load the cached library directly. Importing this module loads the library but registers
nothing: `harness.sim` does, once it has checked that PrivateUse1 is free.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
import torch._appdirs

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
CACHE_SUBDIR = "portharness_sim"


def _cache_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        # = torch.utils.cpp_extension.get_default_build_root(), without importing cpp_extension (0.1 s)
        root = os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions"))
        if not _creatable(Path(root)):
            root = os.path.join(tempfile.gettempdir(), f"torch_extensions_{os.getuid()}")  # read-only home
    return Path(root) / CACHE_SUBDIR


def _creatable(path: Path) -> bool:
    """Whether `path` exists writable or could be created (its nearest existing ancestor is writable)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return os.access(path, os.W_OK)


def _compiler() -> str:
    from torch.utils.cpp_extension import get_cxx_compiler

    return get_cxx_compiler()


def _compile_flags(name: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    flags = ["-O2", "-fPIC", "-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    return flags + [f"-I{p}" for p in [*include_paths(), sysconfig.get_path("include")]]


def _link_flags() -> list[str]:
    from torch.utils.cpp_extension import library_paths

    flags = ["-shared"]
    for p in library_paths():
        flags += [f"-L{p}", f"-Wl,-rpath,{p}"]
    flags += ["-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
    if sys.platform == "darwin":
        flags += ["-undefined", "dynamic_lookup"]
    return flags


def _build_key() -> str:
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    # The torch install path too: the library links (rpath) against that install's libc10.
    for part in (torch.__version__, str(torch.version.git_version), os.path.dirname(torch.__file__), sys.version,
                 str(sysconfig.get_config_var("EXT_SUFFIX")), sys.platform):
        h.update(part.encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive lock the kernel releases if the holder dies (no stale lock files)."""
    import fcntl

    with open(lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmds: list[list[str]]) -> None:
    """Run the compiler commands in parallel; RuntimeError with the first failure's output."""
    procs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) for cmd in cmds]
    failed = None
    for cmd, proc in procs:
        _out, err = proc.communicate()
        if proc.returncode != 0 and failed is None:
            failed = (cmd, proc.returncode, err)
    if failed is not None:
        cmd, code, err = failed
        raise RuntimeError(f"building the sim native backend failed (compiler exit {code}):\n  {' '.join(cmd)}\n"
                           f"{err[-4000:]}")


def _compile(name: str, out: Path) -> None:
    cxx = _compiler()
    if shutil.which(cxx) is None:
        raise RuntimeError(
            f"the sim backend needs a C++ compiler to build its native part ({CSRC.name}/) once, on first use, "
            f"and found none ({cxx!r} is not on PATH). Install g++ or clang++, or set CXX to one; the build is "
            f"cached under {out.parent.parent}."
        )
    tag = f"{os.getpid()}.tmp"
    objects = [out.with_name(f"{src.stem}.{tag}.o") for src in SOURCES]
    tmp = out.with_name(f"{out.name}.{tag}")
    try:
        flags = _compile_flags(name)
        _run([[cxx, "-c", str(src), "-o", str(obj), *flags] for src, obj in zip(SOURCES, objects, strict=True)])
        _run([[cxx, *map(str, objects), "-o", str(tmp), *_link_flags()]])
        os.replace(tmp, out)  # atomic: a concurrent reader sees no library or a complete one
    finally:
        tmp.unlink(missing_ok=True)
        for obj in objects:
            obj.unlink(missing_ok=True)


def _notice(text: str) -> None:
    """One line on stderr (stdout may be a command's JSON): a silent minutes-long first import looks hung."""
    print(f"portharness: {text}", file=sys.stderr, flush=True)


def library_path() -> Path:
    """Where the compiled library for this source/torch/Python lives (built or not)."""
    key = _build_key()
    name = f"portharness_sim_{key}"
    return _cache_root() / key / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"


def load() -> ModuleType:
    """The native module, built first if this source/torch/Python combination has no cached build."""
    path = library_path()
    name = path.name.split(".")[0]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(path.with_name("build.lock")):
            if not path.exists():  # another process may have built it while we waited
                _notice(f"building sim's C++ library (first run only: about 50 s on two idle cores, minutes on a "
                        f"busy host; cached in {path.parent})")
                t0 = time.monotonic()
                _compile(name, path)
                _notice(f"built sim's C++ library in {time.monotonic() - t0:.0f} s")
    spec = importlib.util.spec_from_file_location(
        name, path, loader=importlib.machinery.ExtensionFileLoader(name, str(path))
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ext = load()
