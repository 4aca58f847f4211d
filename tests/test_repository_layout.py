"""The repository's folders keep their roles, read from the source (ast).

``examples/`` holds recipes a user copies: each at most 200 lines, and none imported by another
part of the repository (the tests run them as scripts). The proof and frontier engine is the
package ``benchmarks/proof``, which the benchmarks import normally: nothing in ``benchmarks/``
or the package puts a folder on ``sys.path`` or loads a file by its path.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.py"))
#: calls that load a module from a file or make a folder importable
LOADERS = {"load_script", "spec_from_file_location", "import_module", "insert", "append"}


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def strings_in(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def imported_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def loads_of_examples(tree: ast.AST) -> list[str]:
    """Calls that load a file or a folder of ``examples/`` (``load_script("examples/x.py")``,
    ``sys.path.insert(0, ROOT / "examples")``...): running an example as a script (a subprocess, or
    ``runpy`` as ``__main__``, as ``benchmarks/clients/olmo_trace.py`` does) is not one."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in LOADERS and any("examples" in s for s in strings_in(node)):
                out.append(ast.unparse(node))
    return out


def test_every_example_is_a_recipe_of_at_most_200_lines():
    assert EXAMPLES
    long = {p.name: n for p in EXAMPLES if (n := len(p.read_text(encoding="utf-8").splitlines())) > 200}
    assert not long, f"examples over 200 lines: {long}"


def test_no_part_of_the_repository_imports_an_example():
    stems = {p.stem for p in EXAMPLES}
    found = {}
    for path in python_files("cbs_tracker", "integrations", "benchmarks", "scripts", "tests"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bad = [n for n in imported_names(tree) if n.split(".")[0] in stems | {"examples"}] + loads_of_examples(tree)
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    assert not found, found


def test_the_benchmarks_import_the_proof_package_without_touching_sys_path():
    touching = {}
    # benchmarks/clients/trace.py runs a client script as ``python script.py`` would (its folder first on
    # sys.path): the interpreter's job, done for a script it then runs, not a way to import one
    files = [*sorted((ROOT / "benchmarks").glob("*.py")), *python_files("benchmarks/proof", "cbs_tracker", "integrations")]
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        hits = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
                and isinstance(n.value, ast.Name) and n.value.id == "sys"]
        if hits:
            touching[str(path.relative_to(ROOT))] = hits
    assert not touching, touching
    frontier = imported_names(ast.parse((ROOT / "benchmarks" / "frontier.py").read_text(encoding="utf-8")))
    assert {"proof.gpt_proof", "proof.gpt_proof_lr"} <= frontier
    assert (ROOT / "benchmarks" / "proof" / "__init__.py").exists()
