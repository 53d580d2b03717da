"""The package's shape: no import cycles, imports run down the floors and no two packages
import each other, the config stays frozen, the Trainer does not branch on the parallel
layout, the task or the engine, and neither train/ nor tasks/ tests a degree or an engine:
they ask the layout or the plan (distlm/layout/, distlm/parallel/applied.py)."""
import ast
import dataclasses
from pathlib import Path

import pytest

from distlm.config import load_config
from distlm.layout import AXES

PKG = Path(__file__).resolve().parents[1] / "distlm"

# The floors, lowest first. A module imports its own package and packages on lower floors
# only (function-local imports included: a lazy import that goes upward is still a
# dependency); packages that share a floor import nothing from each other. A package is
# ``distlm.X``: a folder, or a module directly under distlm/.
FLOORS = [
    ("distlm.errors", "distlm.local_shard", "distlm.cache_home", "distlm.host", "distlm.folders"),
    ("distlm.layout", "distlm.bytecode",   # the axes' rules run inside config validation; the
     "distlm.bounded_yaml", "distlm.io"),  # program's entry sets the bytecode folder before torch;
                                           # config files are read within their bounds; writers
                                           # refuse in one line (errors.ConfigError)
    ("distlm.config",),
    ("distlm.device", "distlm.data", "distlm.checkpoint"),
    ("distlm.corpus",),                 # the offline prepare pipeline writes what data/ reads
    ("distlm.model",),
    ("distlm.report",),                 # plots and samples, for the Trainer, the tasks and the command line
    ("distlm.parallel", "distlm.interop"),
    ("distlm.optim",),                  # built by the Trainer; their declared state counted by the planner
    ("distlm.planner",),                # its memory estimate picks the Trainer's auto micro-batch
    ("distlm.tasks",),
    ("distlm.train",),
    ("distlm.bench", "distlm.launch"),
    ("distlm.cli",),
    ("distlm.__main__",),
]
# There is no list of allowed exceptions: an upward import is a bug.


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p

    def owner(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                target = owner(n) if n.startswith("distlm") else ""
                if target and target != m and not m.startswith(target + "."):
                    graph[m].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]):
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def floor_of(package: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if package in names)


def package_graph() -> dict[str, set[str]]:
    """distlm.X -> the other distlm.Y it imports (the root package, distlm/__init__.py, aside)."""
    out: dict[str, set[str]] = {}
    for m, targets in import_graph().items():
        if m == "distlm":
            continue
        src = package_of(m)
        out.setdefault(src, set()).update(package_of(t) for t in targets if t != "distlm" and package_of(t) != src)
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{src} imports {dst}" for src, dsts in graph.items() for dst in sorted(dsts) if floor_of(dst) >= floor_of(src)]


def mutual_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted({tuple(sorted((a, b))) for a, dsts in graph.items() for b in dsts if a in graph.get(b, ())})


def test_the_checks_see_the_imports_and_catch_a_planted_fault():
    """The graph holds the imports everyone knows of, and each check fails on a graph that
    breaks its rule (so the checks below cannot pass by seeing nothing)."""
    graph = package_graph()
    assert {"distlm.config", "distlm.model"} <= graph["distlm.train"] and "distlm.train" in graph["distlm.cli"]
    planted = {**graph, "distlm.config": graph["distlm.config"] | {"distlm.train"}}
    assert "distlm.config imports distlm.train" in upward_imports(planted)
    assert ("distlm.config", "distlm.train") in mutual_imports(planted)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_every_package_has_a_floor():
    placed = {p for names in FLOORS for p in names}
    missing = sorted(set(package_graph()) - placed)
    assert not missing, f"packages on no floor of tests/test_layout.py FLOORS: {missing}"


def test_imports_go_down_the_floors():
    wrong = upward_imports(package_graph())
    assert not wrong, wrong


def test_no_package_pair_imports_each_other():
    assert mutual_imports(package_graph()) == []


def test_config_is_frozen_after_load():
    cfg = load_config("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.max_steps = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = None


def test_trainer_has_no_branch_on_layout_task_or_engine():
    """Modes are objects (task, stepper, engine): no `if` in trainer.py asks which one runs."""
    tree = ast.parse((PKG / "train" / "trainer.py").read_text())
    words = ("pp", "tp", "task", "engine", "horovod", "classify", "pipeline", "parts", "dp_shard", "dp_replicate")
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)):
            text = ast.unparse(node.test)
            if any(w in text.replace(".", " ").replace("_", " ").split() or f".{w}" in text for w in words):
                offenders.append(text)
    assert not offenders, offenders


# A degree is named by its axis (the registry's names, so an axis added there is covered);
# an engine by the word or its one alternative's name.
DEGREE_WORDS = frozenset(a.name for a in AXES)
ENGINE_WORDS = frozenset({"engine", "horovod"})


def conditions(tree: ast.AST):
    """Every condition of ``tree``: the test of an if, ternary, while or assert, every
    comparison, and the operands a boolean operation tests, wherever they stand (an
    assignment, a return, an argument). The last operand of ``a or b`` is its value, not a
    test (``dims or engine.init(...)`` picks a value; a comparison inside it is still one)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            yield node.test
        elif isinstance(node, ast.Compare):
            yield node
        elif isinstance(node, ast.BoolOp):
            yield from node.values[:-1]


def named(expr: ast.AST) -> set[str]:
    """The names an expression mentions: variables, attributes and string constants
    (``getattr(p, "tp")``, ``engine == "horovod"``)."""
    out = set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)
    return out


def conditions_naming(folders: list[Path], words: frozenset) -> list[str]:
    """One line per source line that holds such a condition (its widest one shown)."""
    found: dict[tuple[str, int], ast.AST] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for cond in conditions(ast.parse(path.read_text())):
                key = (str(path.relative_to(PKG.parent)), cond.lineno)
                if named(cond) & words and (key not in found or len(ast.unparse(cond)) > len(ast.unparse(found[key]))):
                    found[key] = cond
    return [f"{file}:{line}: {ast.unparse(c)} (names {', '.join(sorted(named(c) & words))})"
            for (file, line), c in sorted(found.items())]


def test_train_and_tasks_never_test_a_degree_or_an_engine():
    """The layout's questions are answered by the layout and the plan: a condition in train/ or
    tasks/ that names a degree or an engine is a layout rule in the wrong room."""
    offenders = conditions_naming([PKG / "train", PKG / "tasks"], DEGREE_WORDS | ENGINE_WORDS)
    assert not offenders, "\n".join(offenders)


def test_config_holds_no_axis_rule():
    """config.py is the schema and its parsing: what an axis refuses is the axis's
    (distlm/layout/<axis>.py)."""
    tree = ast.parse((PKG / "config.py").read_text())
    offenders = [ast.unparse(c) for c in conditions(tree) if named(c) & DEGREE_WORDS]
    assert not offenders, offenders


def test_the_condition_finder_sees_each_form():
    """What the two tests above look for, shown on each kind of condition they must catch."""
    src = ("if dims.tp > 1: pass\n"
           "x = a if p.pp == 1 else b\n"
           "ok = cfg.parallel.dp_shard == 1 and ready\n"
           "f(getattr(p, 'dp_replicate') > 1)\n"
           "while engine.name == 'horovod': pass\n"
           "go = dims.pp > 1 or fallback\n"
           "y = dims.tp * 2\n"                     # arithmetic, not a condition
           "d = dims or engine.init(cfg)\n")       # a value picked, not an engine tested
    lines = {}
    for c in conditions(ast.parse(src)):
        lines.setdefault(c.lineno, set()).update(named(c) & (DEGREE_WORDS | ENGINE_WORDS))
    assert {n: w for n, w in lines.items() if w} == {1: {"tp"}, 2: {"pp"}, 3: {"dp_shard"}, 4: {"dp_replicate"},
                                                     5: {"engine", "horovod"}, 6: {"pp"}}
