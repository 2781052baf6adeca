"""The package's modules import one another in one direction (issue 24): no cycle, counting the imports made inside
functions too (a lazy import hides a cycle from Python, not from the reader)."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "llm_engine"

def imports_of(f: Path) -> set[str]:
    "The llm_engine modules that `f` imports, at the top or inside functions."
    out = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level: base = f"llm_engine.{base}" if base else "llm_engine"
            if base == "llm_engine": out |= {f"llm_engine.{a.name}" for a in node.names}
            elif base.startswith("llm_engine."): out.add(base)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("llm_engine.")}
    mods = {f"llm_engine.{p.stem}" for p in PKG.glob("*.py")}
    return {m for m in out if m in mods} - {f"llm_engine.{f.stem}"}

def graph() -> dict[str, set[str]]:
    return {f"llm_engine.{f.stem}": imports_of(f) for f in PKG.glob("*.py") if f.stem not in ("__init__", "_modidx")}

def cycles(g) -> list[list[str]]:
    "Every module that can reach itself, with one such path."
    found = []
    for start in sorted(g):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(g.get(node, ())):
                if nxt == start: found.append(path + [start]); stack = []; break
                if nxt not in seen: seen.add(nxt); stack.append((nxt, path + [nxt]))
    return found

def test_the_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []

def test_model_precision_runner_import_one_way():
    g = graph()
    assert "llm_engine.model" in g["llm_engine.precision"] and "llm_engine.model" in g["llm_engine.runner"]
    assert not g["llm_engine.model"] & {"llm_engine.precision", "llm_engine.runner"}, g["llm_engine.model"]

def test_no_import_cycle_below_the_command_line():
    # `cli` is the top: it starts the server, the page, the replicas and the benchmarks, and the entry points of those
    # (`python -m llm_engine.web`, a replica's app) borrow its argument parsing back; every other module is in one order
    g = {m: deps - {"llm_engine.cli"} for m, deps in graph().items() if m != "llm_engine.cli"}
    assert cycles(g) == []
    assert any("llm_engine.cli" in deps for deps in graph().values())     # what is left out is there to leave out
