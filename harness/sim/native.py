"""sim's native part (``csrc/sim_device.cpp``): built on first use, cached, loaded in every process.

Why C++ at all: torch 2.13 accepts a PrivateUse1 device guard from Python, but that guard
(torch/csrc/acc/Module.cpp) hard-codes one device and ignores setDevice, and the autograd engine
sizes its per-device queues from it, so backward through ``sim:1`` fails; there is no Python hook
for its deviceCount/getDevice/setDevice. ``torch.accelerator``'s memory API wants a
``c10::DeviceAllocator`` registered for the device type, which Python cannot provide either. The
source uses only c10 and the CPython API, so it compiles in seconds.

Build: the compiler and include/library paths come from `torch.utils.cpp_extension` (``$CXX`` or
``c++``). The library lands in ``$TORCH_EXTENSIONS_DIR`` (default: torch's extension cache,
``~/.cache/torch_extensions``) under ``portharness_sim/<hash>/``, the hash covering the source,
torch and Python versions and the flags, so worktrees and upgrades never share a stale build.
An exclusive file lock makes concurrent first imports (pytest-xdist workers, spawned ranks) build
once; the others wait and load the result. Later imports load the cached library directly.
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
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
import torch._appdirs

SOURCE = Path(__file__).with_name("csrc") / "sim_device.cpp"
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


def _flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    flags = ["-O2", "-fPIC", "-shared", "-std=c++20", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    flags += [f"-I{p}" for p in [*include_paths(), sysconfig.get_path("include")]]
    for p in library_paths():
        flags += [f"-L{p}", f"-Wl,-rpath,{p}"]
    flags.append("-lc10")
    if sys.platform == "darwin":
        flags += ["-undefined", "dynamic_lookup"]
    return flags


def _build_key(source: bytes) -> str:
    h = hashlib.sha256(source)
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


def _compile(name: str, out: Path) -> None:
    cxx = _compiler()
    if shutil.which(cxx) is None:
        raise RuntimeError(
            f"the sim backend needs a C++ compiler to build its device runtime ({SOURCE.name}) once, on first "
            f"use, and found none ({cxx!r} is not on PATH). Install g++ or clang++, or set CXX to one; the build "
            f"is cached under {out.parent.parent}."
        )
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [cxx, str(SOURCE), "-o", str(tmp), f"-DTORCH_EXTENSION_NAME={name}", *_flags()]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(
            f"building the sim device runtime failed (compiler exit {proc.returncode}):\n  {' '.join(cmd)}\n"
            f"{proc.stderr[-4000:]}"
        )
    os.replace(tmp, out)  # atomic: a concurrent reader sees no library or a complete one


def library_path() -> Path:
    """Where the compiled library for this source/torch/Python lives (built or not)."""
    key = _build_key(SOURCE.read_bytes())
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
                _compile(name, path)
    spec = importlib.util.spec_from_file_location(
        name, path, loader=importlib.machinery.ExtensionFileLoader(name, str(path))
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ext = load()
