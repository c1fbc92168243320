"""The stages of `harness/` import only the stages before them (README, "How it flows"), and no module is
much over 500 lines, and no import runs in a circle: read from the code's own imports, every one of them (lazy ones inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "harness"

# README's table, top to bottom: a module may import its own stage and the ones before it.
STAGES: list[tuple[str, ...]] = [
    ("outcomes", "phases", "verdict", "speed", "files", "csvio", "comms"),
    ("sim",),
    ("results",),
    ("backends",),
    ("models",),
    ("analysis", "console"),
    ("run",),
    ("ops",),
    ("parallel",),
    ("report",),
    ("fleet",),
    ("bench",),
    ("cli", "autoload"),
]
RANK = {name: i for i, names in enumerate(STAGES) for name in names}
MAX_LINES = 500


def _stage(module: str) -> str:
    """`harness.run.pipeline` -> `run`; `harness.files` -> `files`."""
    return module.split(".")[1]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Every harness module `path` imports, at the top or inside a function."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("harness.") and m.count(".") >= 1}


def test_every_stage_of_harness_is_in_the_readmes_table() -> None:
    stages = {_stage(m) for m in _modules() if m != "harness"}
    assert stages - {"__main__"} <= set(RANK), f"stages missing from README's table: {stages - set(RANK)}"


def test_no_stage_imports_a_later_one() -> None:
    upward = []
    for module, path in _modules().items():
        if module == "harness" or _stage(module) not in RANK:
            continue
        for imported in _imports(module, path):
            stage = _stage(imported)
            if stage in RANK and RANK[stage] > RANK[_stage(module)]:
                upward.append(f"{module} -> {imported}")
    assert not upward, "imports running back up the stages:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize("folder", ["run"])
def test_the_one_model_pipeline_stays_one_folder_of_at_most_20_modules(folder: str) -> None:
    assert len(list((ROOT / folder).glob("*.py"))) <= 20


def test_no_module_is_much_over_500_lines() -> None:
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES + 10}
    assert not long, f"split these by concept: {long}"


def test_no_import_circles() -> None:
    """Within a stage too: no module reaches itself through imports (lazy ones and type-only ones count)."""
    import graphlib

    modules = _modules()
    graph = {m: {i for i in _imports(m, p) if i in modules and i != m and not m.startswith(i + ".")}
             for m, p in modules.items()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail("import circle: " + " -> ".join(e.args[1]))
