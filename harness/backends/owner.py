"""Whose code a traceback frame is: the target backend's own, or anybody else's (torch, the model, us).

A relayed dispatcher error ("Could not run 'aten::X' with arguments from the 'CPU' backend") is the
target's missing op, and a connection error is the device's in every phase, only when the backend's own
code raised or passed it on. The backend's code is the packages it is known by, never its device
module's ``__file__`` alone: a Python backend may register a module object made at run time (no file).
The rule (`BackendCode.of`), each source giving module names:

  source                                          | gives
  ------------------------------------------------+--------------------------------------------------
  ``--backend`` / ``PORTHARNESS_BACKENDS`` modules | each module's name
  ``torch.backends`` entry points, once imported   | the module each one names (``npu_toy:_autoload``)
  the device module (`torch.get_device_module`)    | a module with a file: its name; an object made at
                                                   | run time: the ``__module__`` of its functions; an
                                                   | instance: its class's ``__module__``
  the PrivateUse1 registration (target's name)     | the Python file that registered its
                                                   | ``empty.memory_format`` / ``empty_strided`` kernel

and a name stands for its package (`package_of`): the top-level package (``npu_toy.remote`` ->
``npu_toy``), inside portharness the backend's subpackage (``harness.sim.device`` -> ``harness.sim``).
Never torch's (its frames are on every traceback), portharness's own, or the standard library's (a
``socket`` frame is on every connection error, a model's download included). A frame is the backend's
when the module it runs in (``f_globals["__name__"]``) is in one of those packages, or its file lies in
one of their directories.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

NEVER = frozenset({"torch", "builtins", "__main__"})
_REGISTERED_AT = re.compile(r"^PrivateUse1: registered at (?P<file>.+?):\d+ \[kernel\]", re.MULTILINE)
_given: list[str] = []  # modules imported with --backend / PORTHARNESS_BACKENDS in this process
_known: dict[str, BackendCode] = {}


def note_given(names: Iterable[str]) -> None:
    """Remember the backend modules this process imported (`harness.backends.load_backends`)."""
    _given.extend(n for n in names if n not in _given)
    _known.clear()


def backend_code(kind: str) -> BackendCode:
    """`BackendCode.of(kind)`, once the backend is loaded (until more backend modules are imported)."""
    import torch

    if kind not in _known:
        try:
            torch.get_device_module(kind)
        except (RuntimeError, AttributeError, ValueError):
            return BackendCode.of(kind)  # not loaded yet: nothing to remember
        _known[kind] = BackendCode.of(kind)
    return _known[kind]


def package_of(module_name: str | None) -> str | None:
    """The package a module name stands for (module docstring), or None where it can be nobody's backend."""
    if not module_name:
        return None
    parts = module_name.split(".")
    top = parts[0]
    if top == "harness":  # our own code, but for the one backend portharness ships
        return "harness.sim" if parts[1:2] == ["sim"] else None
    if top in NEVER or top in sys.stdlib_module_names:
        return None
    return top


def device_module_names(module: object) -> list[str]:
    """Module names the device module object is known by (the rule's third row)."""
    if isinstance(module, types.ModuleType):
        if getattr(module, "__file__", None):
            return [module.__name__]
        names = [module.__name__]
        for value in vars(module).values():  # made at run time: its functions say where they come from
            value = getattr(value, "__func__", value)
            if callable(value) and isinstance(getattr(value, "__module__", None), str):
                names.append(value.__module__)
        return names
    return [type(module).__module__] if module is not None else []


def registrar_files(dispatch_tables: Iterable[str]) -> list[str]:
    """The Python files that registered PrivateUse1 kernels, from `torch._C._dispatch_dump_table` texts."""
    files = []
    for text in dispatch_tables:
        for m in _REGISTERED_AT.finditer(text):
            if m["file"].endswith(".py"):
                files.append(m["file"])
    return files


@dataclass(frozen=True)
class BackendCode:
    """The target backend's packages and where their files lie."""

    packages: frozenset[str] = frozenset()
    roots: tuple[str, ...] = ()  # package directories (ending in the separator) and single-file modules

    @classmethod
    def from_names(cls, names: Iterable[str], files: Iterable[str] = (),
                   modules: Mapping[str, object] | None = None) -> BackendCode:
        """The packages `names` stand for and the packages of `files` (modules loaded from them), with
        their directories as `modules` (default `sys.modules`) knows them. A file no loaded module came
        from stands for itself."""
        modules = sys.modules if modules is None else modules
        by_file = {}
        files = [os.path.realpath(f) for f in files]
        if files:
            for name, mod in list(modules.items()):
                path = getattr(mod, "__file__", None)
                if isinstance(path, str):
                    by_file.setdefault(os.path.realpath(path), name)
        packages = {p for p in map(package_of, [*names, *(by_file.get(f) for f in files)]) if p}
        roots: list[str] = [f for f in files if f not in by_file and os.path.basename(f) != "__init__.py"]
        roots += [os.path.dirname(f) + os.sep for f in files if f not in by_file and os.path.basename(f) == "__init__.py"]
        for pkg in sorted(packages):
            mod = modules.get(pkg)
            for path in getattr(mod, "__path__", None) or []:
                roots.append(os.path.realpath(path) + os.sep)
            path = getattr(mod, "__file__", None)
            if isinstance(path, str) and not getattr(mod, "__path__", None):
                roots.append(os.path.realpath(path))
        return cls(frozenset(packages), tuple(dict.fromkeys(roots)))

    @classmethod
    def of(cls, kind: str) -> BackendCode:
        """The code of the backend serving device type `kind` in this process (the rule above)."""
        import torch

        names = list(_given)
        for ep in importlib.metadata.entry_points(group="torch.backends"):
            module = ep.value.partition(":")[0].strip()
            if module in sys.modules:  # loaded: by torch's autoload, or by the backend's users
                names.append(module)
        try:
            names += device_module_names(torch.get_device_module(kind))
        except (RuntimeError, AttributeError, ValueError):
            pass
        files: list[str] = []
        if kind == torch._C._get_privateuse1_backend_name():
            tables = []
            for op in ("aten::empty.memory_format", "aten::empty_strided"):
                try:
                    tables.append(torch._C._dispatch_dump_table(op))
                except RuntimeError:
                    pass
            files = [f for f in registrar_files(tables) if os.path.isfile(f)]
        return cls.from_names(names, files)

    def owns(self, module_name: str | None, filename: str) -> bool:
        """Whether a frame running in module `module_name`, from `filename`, is the backend's code."""
        if module_name and package_of(module_name) in self.packages:
            return True
        if not self.roots or not filename or filename.startswith("<"):
            return False
        path = os.path.realpath(filename)
        return any(path == r or (r.endswith(os.sep) and path.startswith(r)) for r in self.roots)

    def raised(self, exc: BaseException) -> bool:
        """Whether the backend's code is on `exc`'s traceback (it raised or passed it on)."""
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if self.owns(frame.f_globals.get("__name__"), frame.f_code.co_filename):
                return True
            tb = tb.tb_next
        return False
