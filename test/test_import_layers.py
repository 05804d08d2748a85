"""The import layering of server/ (docs/architecture.md, "The layers"), read from the sources:

- no import cycle between its modules, counting the imports a module makes as it loads (those
  inside functions or under `if TYPE_CHECKING:` are left out: they run later or never);
- the layers the protocol packages share import no protocol package: server.api.generation (the
  engine jobs and ChoiceStream of the OpenAI routes and lightning's batch routes) and
  server.api.streaming. So openai and lightning both import the shared layer, and neither
  imports the other for it;
- the protocol packages depend on each other one way only, as DEPENDS says, counting every
  import (one inside a function too): lightning and responses build on openai (lightning's
  POST /v1/chat/completions hands an OpenAI body to openai's chat handler, its OpenAI-style route
  re-serves openai's shapes; responses share the tool-call format), and openai imports neither.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "server"
SHARED = ("server.api.generation", "server.api.streaming")
PROTOCOLS = ("server.api.openai", "server.api.lightning", "server.api.responses", "server.api.tasks",
             "server.api.states")  # fmt: skip
DEPENDS = {
    "server.api.openai": (),
    "server.api.lightning": ("server.api.openai",),
    "server.api.responses": ("server.api.openai",),
    "server.api.tasks": (),
    "server.api.states": (),
}
"""The protocol packages each protocol package may import (any other is refused)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _load_time_nodes(body: list[ast.stmt]) -> list[ast.AST]:
    """The nodes of the statements `body` that run as the module loads: not a function's body (a
    class's methods included), not an `if TYPE_CHECKING:` block (its `else:` runs)."""
    out: list[ast.AST] = []
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            out += _load_time_nodes(stmt.orelse)
            continue
        out.append(stmt)
        for field in ("body", "orelse", "finalbody", "handlers"):  # blocks: class, if, try, with
            block = getattr(stmt, field, None)
            if isinstance(block, list):
                out += _load_time_nodes([b for b in block if isinstance(b, ast.stmt)])
                out += [n for h in block if isinstance(h, ast.ExceptHandler) for n in _load_time_nodes(h.body)]
    return out


def load_time_imports(path: Path, modules: set[str], *, lazy: bool = False) -> set[str]:
    """The modules of `modules` that `path` imports as it loads (lazy: those it imports anywhere,
    in a function or under `if TYPE_CHECKING:` too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree) if lazy else _load_time_nodes(tree.body):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    found.add(sub)
                elif base in modules:
                    found.add(base)
    return found - {name}


def import_graph(*, lazy: bool = False) -> dict[str, set[str]]:
    paths = sorted(SERVER.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): load_time_imports(p, modules, lazy=lazy) for p in paths}


def test_the_graph_reader_sees_imports() -> None:
    graph = import_graph()
    assert "server.api.generation.jobs" in graph["server.api.generation.stream"]
    assert "server.engine.types" in graph["server.engine.scheduler"]  # a relative import
    assert "server.api.generation.jobs" in graph["server.api.lightning.batch"]
    assert "server.api.services" not in graph["server.api.lightning.schemas"]  # under TYPE_CHECKING
    assert "server.api.services" in import_graph(lazy=True)["server.api.lightning.schemas"]


def test_no_import_cycle_in_server() -> None:
    graph = import_graph()
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        assert m not in path, f"import cycle: {' -> '.join(path[path.index(m) :] + [m])}"
        if m in done:
            return
        for d in sorted(graph.get(m, ())):
            visit(d, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_the_shared_api_layers_import_no_protocol() -> None:
    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if m.startswith(SHARED)
                 for d in deps if d.startswith(PROTOCOLS))  # fmt: skip
    assert not bad, f"a shared layer imports a protocol package: {bad}"


def _package(module: str) -> str | None:
    return next((p for p in PROTOCOLS if module == p or module.startswith(p + ".")), None)


def test_the_protocol_packages_depend_one_way() -> None:
    """openai imports nothing of lightning (nor of any other protocol): the path lightning's V1
    batch shares with the OpenAI chat is routed by lightning (server.api.lightning.v1_chat)."""
    assert set(DEPENDS) == set(PROTOCOLS)
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in import_graph(lazy=True).items()
        if (mine := _package(m)) is not None
        for d in deps
        if (theirs := _package(d)) not in (None, mine) and theirs not in DEPENDS[mine]
    )
    assert not bad, f"a protocol package imports one it may not (DEPENDS): {bad}"
