"""The package's import graph, read from its source (ast), against the layering docs/design.md states.

docs/design.md ("Who imports whom") gives each layer the layers it may import and lists every
arrow against that, with its reason. Every import in ``cbs_tracker/`` and ``integrations/``, at
module level or inside a function, must be allowed by the first table or listed in the second
(that every listed arrow still exists is a claim of the page: ``tests/test_doc_claims.py``). The
same section names the modules that import no torch and the ones that name ``torch.distributed``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
PACKAGES = {"cbs_tracker": ROOT / "cbs_tracker", "cbs_tracker.integrations": ROOT / "integrations"}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name (``integrations/`` as ``cbs_tracker.integrations``)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


MODULES = modules()


def imports_of(path: Path) -> list[ast.AST]:
    return [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, (ast.Import, ast.ImportFrom))]


def package_imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports; ``from pkg import mod`` counts as ``pkg.mod``."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in imports_of(path):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        out |= {t for t in targets if t == "cbs_tracker" or t.startswith("cbs_tracker.")}
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    return {name: package_imports(name, path) for name, path in MODULES.items()}


# ------------------------------------------------------------------ what design.md states
def _section(heading: str) -> str:
    start = DESIGN.index(f"\n### {heading}\n")
    end = DESIGN.find("\n## ", start + 1)
    return DESIGN[start:] if end < 0 else DESIGN[start:end]


WHO = _section("Who imports whom")


def _rows(header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with ``header``, split into cells."""
    lines = WHO.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _names(cell: str) -> list[str]:
    return re.findall(r"`([A-Za-z0-9_.]+)`", cell)


def layers() -> dict[str, dict]:
    """layer -> its module prefixes, the layers it may import, whether its modules may import each other."""
    out = {}
    for layer, mods, may, *_ in _rows("| layer | modules | may import"):
        out[_names(layer)[0]] = {
            "prefixes": _names(mods),
            "may": None if may.startswith("anything") else set(_names(may)),
            "within": "not one another" not in may,
        }
    return out


LAYERS = layers()
EXCEPTIONS = {(_names(m)[0], _names(i)[0]) for m, i, *_ in _rows("| module | imports | why")}


def layer_of(module: str) -> str:
    """The layer of the longest prefix that holds ``module``."""
    best, length = None, -1
    for name, spec in LAYERS.items():
        for prefix in spec["prefixes"]:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = name, len(prefix)
    assert best is not None, f"{module} is in no layer of docs/design.md"
    return best


def allowed(source: str, target: str) -> bool:
    a, b = layer_of(source), layer_of(target)
    spec = LAYERS[a]
    if (source, target) in EXCEPTIONS:
        return True
    if a == b:
        return spec["within"]
    return spec["may"] is None or b in spec["may"]


def forbidden(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{s} -> {t}" for s, targets in edges.items() for t in targets if not allowed(s, t))


# ------------------------------------------------------------------ the checks
def test_the_tables_were_read():
    assert {"core", "policy", "theory", "calibrate", "integrations", "commands", "runlog", "demo", "api"} <= set(LAYERS)
    assert LAYERS["integrations"]["within"] is False and LAYERS["commands"]["may"] is None
    assert ("cbs_tracker.integrations.accelerate", "cbs_tracker.integrations.plain") in EXCEPTIONS
    assert len(MODULES) > 50 and all(layer_of(m) for m in MODULES)


def test_every_import_of_the_package_keeps_the_layering_design_md_states():
    assert forbidden(graph()) == []


def stale_exceptions() -> list[str]:
    """The arrows design.md lists against the layering that the code no longer has
    (``tests/test_doc_claims.py`` holds it empty)."""
    edges = graph()
    return sorted(f"{s} -> {t}" for s, t in EXCEPTIONS if t not in edges.get(s, set()))


@pytest.mark.parametrize(("source", "target"), [
    ("cbs_tracker.core.estimator", "cbs_tracker.policy.controller"),  # core reaching up
    ("cbs_tracker.integrations.lightning", "cbs_tracker.integrations.plain"),  # one adapter importing another
    ("cbs_tracker.policy.rules", "cbs_tracker.core.session"),  # the policy reaching into the engine
    ("cbs_tracker.theory.schedule", "cbs_tracker.policy.plan"),  # theory reaching into the policy
    ("cbs_tracker.core.session", "cbs_tracker.commands.demo"),  # anything reaching into a command
])
def test_an_arrow_the_layering_forbids_is_found(source, target):
    edges = graph()
    assert forbidden({**edges, source: edges[source] | {target}}) == [f"{source} -> {target}"]


def _listed(sentence_start: str) -> list[str]:
    """The backticked module names of the design page's sentence that begins ``sentence_start``."""
    text = " ".join(WHO.split())
    m = re.search(re.escape(sentence_start) + r"(.*?)\.(?: \*\*|$)", text)
    assert m, f"design.md no longer says {sentence_start!r}"
    return [n for n in _names(m.group(1)) if n.startswith("cbs_tracker")]


def _torch_imports(path: Path) -> tuple[bool, bool]:
    """(imports torch, names torch.distributed) for one file."""
    torch = dist = False
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "torch" else [])
        elif isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.distributed"] if node.value.id == "torch" else []
        else:
            continue
        torch |= any(n == "torch" or n.startswith("torch.") for n in names)
        dist |= any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names)
    return torch, dist


def _in(module: str, prefixes: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_modules_design_md_calls_torch_free_import_no_torch():
    free = _listed("These import no torch:")
    assert "cbs_tracker.policy" in free and "cbs_tracker.core.estimator" in free
    importing = sorted(m for m, p in MODULES.items() if _in(m, free) and _torch_imports(p)[0])
    assert importing == []


def test_torch_distributed_is_named_only_where_design_md_says():
    said = _listed("is named by")
    named = sorted(m for m, p in MODULES.items() if _torch_imports(p)[1])
    assert named == sorted(said)


# ------------------------------------------------------------------ one engine under every adapter
#: the modules that wire the engine into a framework's events (the plain loop's base, under the plain,
#: FSDP2 and Accelerate adapters; Lightning; the HF Trainer; OLMo-core)
ADAPTERS = ("cbs_tracker.core.loop", "cbs_tracker.integrations.lightning", "cbs_tracker.integrations.transformers",
            "cbs_tracker.integrations.olmo_core")
#: the engine's parts, which only ``cbs_tracker.core.engine`` builds or calls
ENGINE_PARTS = {"GradStatsCollector", "TrackingSession", "reduce_window", "count_sizes"}


def called_names(path: Path) -> set[str]:
    """The names ``path`` calls: ``f(...)`` and ``x.f(...)`` both give ``f``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            out.add(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    return out


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_each_adapter_builds_the_engine(adapter):
    assert "Engine" in called_names(MODULES[adapter])


def test_only_the_engine_builds_the_collector_and_the_session_and_reduces_a_window():
    """docs/design.md ("Adapt"): an adapter constructs the engine and calls it; none wires its parts by hand."""
    wired = sorted(f"{m}: {n}" for m, p in MODULES.items() if m != "cbs_tracker.core.engine"
                   for n in called_names(p) & ENGINE_PARTS)
    assert wired == []
