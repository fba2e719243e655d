"""The code each DVC stage runs, so that its `deps` list exactly that code and nothing else.

A stage is a function in specops/pipeline/stages.py (or a step in osd_steps.py) whose imports are
lazy. Its code is that file, the imports in the function and in the same file's helpers it calls, and
everything those modules import in turn, lazy imports included (statically, from the AST). A folder
is listed whole when every module in it is needed. tests/pipeline/test_stage_deps.py checks dvc.yaml
and osd/dvc.yaml against this, so an edit to the server, the docs or another stage's trainer reruns
nothing that does not run it.

    python -m specops.pipeline.stage_deps   # prints each stage's code deps, for dvc.yaml
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from specops.core.native import HEADERS, SOURCES

PACKAGE = Path(__file__).resolve().parents[1]  # specops/
REPO = PACKAGE.parent
STAGE_FILES = {"dvc.yaml": "specops.pipeline.stages", "osd/dvc.yaml": "specops.pipeline.osd_steps"}
# Code a module runs that is not Python: listed beside the module wherever it is (a folder listed whole has it).
# The native decoder's sources and headers as native.py builds them, so a new source cannot be left out here.
COMPANIONS = {"specops/core/native.py": [path.relative_to(REPO).as_posix() for path in (*SOURCES, *HEADERS)]}
# Stage name in a dvc.yaml -> function in its stage file (the OSD stages are `osd_<step>`).
STAGE_FUNCTIONS = {"dvc.yaml": lambda stage: stage, "osd/dvc.yaml": lambda stage: stage.removeprefix("osd_")}


def module_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "specops":
        return None
    base = REPO.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return base / "__init__.py" if (base / "__init__.py").is_file() else None


def _imports(nodes: list[ast.AST]) -> set[str]:
    """specops modules imported anywhere under `nodes` (`from a import b` names a.b when b is a module)."""
    found = set()
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {m for m in found if module_file(m) is not None}


@cache
def _tree(module: str) -> ast.Module:
    path = module_file(module)
    assert path is not None, module
    return ast.parse(path.read_text())


@cache
def module_imports(module: str) -> frozenset[str]:
    return frozenset(_imports([_tree(module)]))


def _function_imports(module: str, function: str) -> set[str]:
    """Imports of a function, of the same module's functions it names (transitively) and of the module's top level."""
    tree = _tree(module)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    if function not in functions:
        raise KeyError(f"{module} has no stage function '{function}'")
    seen, todo = set(), [function]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [n.id for n in ast.walk(functions[name]) if isinstance(n, ast.Name) and n.id in functions]
    top = [node for node in tree.body if not isinstance(node, ast.FunctionDef | ast.ClassDef)]
    return _imports([functions[name] for name in seen] + top) | {module}


def closure(roots: set[str]) -> set[str]:
    done: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module not in done:
            done.add(module)
            todo += module_imports(module) - done
    return done


def stage_modules(stage_module: str, function: str) -> set[str]:
    """Every specops module a stage function may run; the stage file's other stages are left out."""
    roots = _function_imports(stage_module, function)
    return {stage_module} | closure(roots - {stage_module}) | closure(module_imports(stage_module) & roots)


def stage_deps(stage_module: str, function: str) -> list[str]:
    """The stage's code as dvc.yaml deps: files, or a folder when all of its modules are needed."""
    files = {module_file(m) for m in stage_modules(stage_module, function)}
    files = {f for f in files if f is not None and not (f.name == "__init__.py" and not f.read_text().strip())}
    deps: list[str] = []
    for folder in sorted({f.parent for f in files}):
        modules = {p for p in folder.glob("*.py") if not (p.name == "__init__.py" and not p.read_text().strip())}
        subfolders = [d for d in folder.iterdir() if (d / "__init__.py").is_file()]
        if modules <= files and not subfolders:
            deps.append(str(folder.relative_to(REPO)))
        else:
            deps += sorted(str(f.relative_to(REPO)) for f in files if f.parent == folder)
    return sorted(deps + [companion for dep in deps for companion in COMPANIONS.get(dep, [])])


def main() -> None:
    import yaml

    for dvc_file, stage_module in STAGE_FILES.items():
        stages = yaml.safe_load((REPO / dvc_file).read_text())["stages"]
        print(f"# {dvc_file}")
        for stage in stages:
            deps = stage_deps(stage_module, STAGE_FUNCTIONS[dvc_file](stage))
            print(f"{stage}: [{', '.join(deps)}]")


if __name__ == "__main__":
    main()
