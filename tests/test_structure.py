"""The package's shape: no import circles, no module reaching into another's private members, and the
protocol's reasons written once. Read from the source with ``ast`` (imports inside functions count)."""

from __future__ import annotations

import ast
from pathlib import Path

import atoll

ROOT = Path(atoll.__file__).parent
GENERATED = ("_pb2.py", "_pb2_grpc.py")
ALLOWED_PRIVATE = {("os", "_exit")}
"""(object, attribute) pairs of the standard library that are private by name only."""


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.name.endswith(GENERATED):
            continue
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The atoll modules ``name`` imports: ``from atoll.a import b`` is ``atoll.a.b`` when that is a
    module, else ``atoll.a``."""
    got = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            got.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("atoll"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                got.add(sub if sub in known else node.module)
    got.discard(name)
    return got & known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_and_none_hidden_behind_type_checking():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    assert cycles(graph) == []
    hidden = [name for name, path in mods.items() if "TYPE_CHECKING" in path.read_text()]
    assert hidden == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def private_reaches(path: Path, root: Path = ROOT.parent) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self``/``cls`` and ``_name`` is nothing this module defines."""
    tree = ast.parse(path.read_text())
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        base = node.value.id if isinstance(node.value, ast.Name) else None
        if base in ("self", "cls") or node.attr in own or (base, node.attr) in ALLOWED_PRIVATE:
            continue
        out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_module_reaches_into_another_modules_private_members():
    found = [hit for path in modules().values() for hit in private_reaches(path)]
    assert found == []


def test_the_private_reach_finder_finds_one(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f(s):\n    s._reset()\n    self_ok = 1\n")
    assert private_reaches(bad, tmp_path) == ["m.py:2: s._reset"]


ISLAND_PUBLIC = {
    "atoll.islands",
    "atoll.islands.errors",
    "atoll.islands.checkpoint",
    "atoll.islands.client",
    "atoll.islands.session",  # a relay speaks to its upstream as an island does
}
"""The island modules a user imports; the others (``atoll.islands._*``) are internal, as FSDP2's are."""


def test_outside_the_island_package_only_its_public_modules_are_imported():
    """The reference island, the CLI and the coordinator use the island's public surface, as a user
    would; the harness alone reaches in (its fault injection writes half a push with the real writer)."""
    mods = modules()
    island_modules = {name for name in mods if name.startswith("atoll.islands")}
    assert island_modules - ISLAND_PUBLIC and all(
        name.split(".")[2].startswith("_") for name in island_modules - ISLAND_PUBLIC
    )
    reaches = {
        (name, imported)
        for name, path in mods.items()
        if not name.startswith(("atoll.islands", "atoll.harness"))
        for imported in imports_of(name, path, set(mods))
        if imported in island_modules - ISLAND_PUBLIC
    }
    assert reaches == set()


def test_reasons_are_the_protos_and_each_has_a_status_code():
    from atoll.protos import coordinator_pb2 as pb
    from atoll.protos.reasons import CODE, FATAL, Reason, wire_number

    assert {r.value for r in Reason} == {n for n, v in pb.Reason.items() if v}
    assert set(CODE) == set(Reason) and set(Reason) >= FATAL
    assert Reason.NOT_JOINED == "REASON_NOT_JOINED" and wire_number(Reason.NOT_JOINED) == 3
    assert Reason.NOT_JOINED not in FATAL and Reason.MODEL_MISMATCH in FATAL


def test_no_arrow_runs_back_up_from_the_harness_to_the_cli():
    """The CLI wires the product and the harness together (``atoll demo``); the harness starts islands
    through the island's own entry point (:mod:`atoll.workload.command`), never through the CLI."""
    mods = modules()
    up = {
        (name, imported)
        for name, path in mods.items()
        if name.startswith("atoll.harness")
        for imported in imports_of(name, path, set(mods))
        if imported in ("atoll.cli", "atoll.__main__")
    }
    assert up == set()


def module_map_misses(text: str) -> list[str]:
    """The modules of the package that docs/design.md's "Module layout" does not name (by file name)."""
    import re

    start = text.index("## Module layout")
    section = text[start : text.index("\n## ", start + 1)]
    missing = []
    for name, path in modules().items():
        if path.name in ("__init__.py", "__main__.py"):
            continue
        if not re.search(rf"(?<![\w.]){re.escape(path.stem)}(\.py)?(?![\w])", section):
            missing.append(name)
    return missing


def test_the_module_map_in_the_design_names_every_module():
    design = ROOT.parent / "docs" / "design.md"
    assert module_map_misses(design.read_text()) == []
    assert "atoll.compression.sparse" in module_map_misses("## Module layout\nnothing here\n## Next\n")


def test_the_state_is_kept_behind_one_interface():
    """RunState and the writer call the state store (:mod:`atoll.coordinator.disk.store`) the same way
    whether it is a local dir or an object store: neither names the mirror nor asks which it is."""
    for rel in ("coordinator/run/run_state.py", "coordinator/disk/writer.py"):
        source = (ROOT / rel).read_text()
        assert "mirror" not in source.lower(), rel
        assert "ObjectState" not in source and "ObjectStore" not in source, rel


def test_one_vocabulary_no_enum_is_defined_twice():
    """The protocol's words (push kinds, outcomes, update kinds) are defined once
    (:mod:`atoll.protos.vocabulary`) and used by both ends: no two modules define an enum of one name."""
    where: dict[str, list[str]] = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(b) for b in node.bases):
                where.setdefault(node.name, []).append(name)
    twice = {k: v for k, v in where.items() if len(v) > 1}
    assert twice == {}
    assert where["PushOutcome"] == ["atoll.protos.vocabulary"]


def test_one_vocabulary_no_message_is_named_twice_across_the_two_ends():
    """A protocol message both ends speak is one type (:mod:`atoll.protos.messages`); what only one end
    holds has a name of its own there: no class name is defined both on the island side and on the
    coordinator side."""
    where: dict[str, set[str]] = {}
    for name, path in modules().items():
        side = (name.split(".") + [""])[1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, set()).add(side)
    both = sorted(k for k, sides in where.items() if {"islands", "coordinator"} <= sides)
    assert both == []
    for shared in ("Region", "TensorRegion", "Entry", "TensorDecl", "JoinRequest", "PushHeader"):
        assert where[shared] == {"protos"}, shared


def test_benchmarks_use_public_apis_only():
    """The scripts behind benchmarks/RESULTS.md import no private island module: what they need of the
    transport's insides, the harness gives them (:mod:`atoll.harness.transfers`)."""
    bench = ROOT.parent / "benchmarks"
    private = [
        f"{path.name}: {node.module}"
        for path in sorted(bench.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("atoll.islands._")
    ]
    assert private == []


def test_tests_sit_by_concern_and_take_helpers_from_support_not_from_conftest():
    """Test modules live in folders that mirror atoll/ (or at the top for the product as a whole), and
    none imports conftest, another test module or tests.*: helpers come from tests/support, fixtures as
    fixtures."""
    tests = ROOT.parent / "tests"
    folders = {p.parent.name for p in tests.rglob("test_*.py") if p.parent != tests}
    assert folders <= {"compression", "coordinator", "islands", "workload", "harness", "protos", "relay"}
    assert all((ROOT / name).exists() for name in folders)  # each mirrors a part of atoll/
    bad = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
            for name in names:
                if name == "conftest" or name.startswith(("tests.", "test_")) or name == "small_island":
                    bad.append(f"{path.relative_to(tests)}: {name}")
    assert bad == []
