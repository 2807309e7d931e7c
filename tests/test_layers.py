"""The floors of docs/architecture.md hold: import-linter's contracts (pyproject.toml) are kept, and no
project module imports itself through others (no import loop, inside a floor or across floors)."""

from __future__ import annotations

import grimp
from importlinter.cli import lint_imports

from conftest import ROOT


def test_import_linter_contracts_are_kept():
    # Floors (pipelines > runtime > stages > tracking > engine > data > config, errors, ...), stages
    # independent of each other, and no Prefect in the library. Exit code 1 names the broken import.
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def import_loops(graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in graph.modules:
                continue
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                loops.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return loops


def test_no_import_loops():
    graph = grimp.build_graph("components", "pipelines")
    assert import_loops(graph) == []


def test_the_loop_finder_finds_a_loop():
    graph = grimp.build_graph("components", "pipelines")
    graph.add_import(importer="components.config", imported="components.engine.rewards.rewards")  # the loop that was
    loop = ["components.config", "components.engine.models.modeling", "components.engine.rewards.rewards"]
    assert loop in import_loops(graph)


def test_the_engine_floors_are_checked(tmp_path):
    """The engine's floors contract is not vacuous: with its floors reversed, its real imports break it."""
    config = (ROOT / "pyproject.toml").read_text()
    floors = '    "grpo",\n    "evaluation | parallel",\n    "generation",\n    "rewards",\n    "models",\n'
    assert floors in config
    reversed_floors = '    "models",\n    "rewards",\n    "generation",\n    "evaluation | parallel",\n    "grpo",\n'
    (tmp_path / "pyproject.toml").write_text(config.replace(floors, reversed_floors))
    assert lint_imports(config_filename=str(tmp_path / "pyproject.toml"), no_cache=True, no_logo=True) == 1


def test_generations_floors_are_checked(tmp_path):
    """The generation room's floors contract is not vacuous either: reversed, its real imports break it."""
    config = (ROOT / "pyproject.toml").read_text()
    floors = ('    "scoring",\n    "service",\n    "environments | engines",\n    "fast",\n    "logprobs",\n'
              '    "rollouts",\n')
    assert floors in config
    reversed_floors = "".join(reversed(floors.splitlines(keepends=True)))
    (tmp_path / "pyproject.toml").write_text(config.replace(floors, reversed_floors))
    assert lint_imports(config_filename=str(tmp_path / "pyproject.toml"), no_cache=True, no_logo=True) == 1


def test_the_fast_path_has_one_door():
    """Only rollout engines (and their fixed-shape state) import the fast path: no module outside
    components/engine/generation/engines/ reaches it, and the prompt-once engine does (the check is not vacuous)."""
    graph = grimp.build_graph("components", "pipelines")
    fast = "components.engine.generation.fast"
    importers = {m for module in graph.find_children(fast)
                 for m in graph.find_modules_that_directly_import(module) if not m.startswith(fast)}
    assert "components.engine.generation.engines.prefix_shared" in importers
    assert {m for m in importers if not m.startswith("components.engine.generation.engines.")} == set()


def test_concrete_engines_have_one_door():
    """Every engine module an entry of components/rollout_engines.py names is imported only inside the engines
    package (everything else generates through generation.service, or asks `choose`)."""
    from components.rollout_engines import ENGINES

    graph = grimp.build_graph("components", "pipelines")
    outside = {(m, e.module_path) for e in ENGINES.values() for m in graph.find_modules_that_directly_import(
        e.module_path) if not m.startswith("components.engine.generation.engines.")}
    assert outside == set()
    assert len(ENGINES) >= 3 and all(e.module_path in graph.modules for e in ENGINES.values())


# Private members of other libraries' objects that the library reads on purpose, each with its reason.
THIRD_PARTY_PRIVATES = {
    "_linear_pointwise": "oneDNN's fused linear, torch.ops.mkldnn (engine/generation/fast/matmul.py)",
    "_forward_hooks": "a hooked nn.Linear head must run as a module (engine/generation/fast/pieces.py)",
    "_forward_pre_hooks": "the same",
    "_gradient_checkpointing_func": "transformers' per-layer checkpointing switch (engine/models/modeling.py)",
    "_exit": "os._exit in the stage server's forked children",
}


def foreign_private_reads(source: str) -> list[str]:
    """`obj._name` reads in `source` outside `self`/`cls`, of a name the source does not define itself and that is
    not a listed third-party private."""
    import ast

    tree = ast.parse(source)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    defined |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    reads = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if node.attr not in defined and node.attr not in THIRD_PARTY_PRIVATES:
            reads.append(f"{node.lineno} {ast.unparse(node)}")
    return reads


def test_no_module_reads_another_modules_private_members():
    """Pieces one module needs from another are public (the fast path's layer pieces were private once)."""
    offenders = [f"{path.relative_to(ROOT)}:{read}"
                 for path in sorted((ROOT / "components").rglob("*.py")) + sorted((ROOT / "pipelines").rglob("*.py"))
                 for read in foreign_private_reads(path.read_text())]
    assert offenders == []


def test_the_private_member_check_finds_one():
    assert foreign_private_reads("def f(lm):\n    return lm._attend(1)\n") == ["2 lm._attend"]
    assert foreign_private_reads("class A:\n    def _attend(self):\n        pass\n\ndef f(a):\n"
                                 "    return a._attend()\n") == []  # defined in the same module


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 80


def oversized(path, source: str) -> list[str]:
    """A module over MAX_MODULE_LINES lines, and each function over MAX_FUNCTION_LINES lines."""
    import ast

    found = [f"{path}: {source.count(chr(10))} lines"] if source.count("\n") > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


def test_library_modules_and_functions_stay_small():
    """Rooms a newcomer can read: split by what each part does (a function of the loop, a module per role)."""
    files = sorted((ROOT / "components").rglob("*.py")) + sorted((ROOT / "pipelines").rglob("*.py"))
    assert [line for path in files for line in oversized(path.relative_to(ROOT), path.read_text())] == []


def test_the_size_check_finds_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert oversized("m.py", f"def f():\n{body}\n") == [f"m.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
    assert oversized("m.py", "x = 1\n" * (MAX_MODULE_LINES + 1)) == [f"m.py: {MAX_MODULE_LINES + 1} lines"]
