"""lmforge's import graph: no cycle between modules, no cycle between folders, and no import from a
lower layer to a higher one, with the layers ARCHITECTURE.md's table gives each folder (one layer
per folder: the table lists folders and top-level modules, never a module inside a folder). Every
import counts, top-level and deferred (inside functions), except those under `if TYPE_CHECKING:`
(never executed).

And one home for each concern, read from the syntax tree (docstrings and comments do not count):
cross-entropy / log-softmax only in lmforge.model.loss, and no branch on the parallel layout in
the trainer (lmforge.train.trainer drives every layout through `Layout`)."""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lmforge"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def table_entries(text: str | None = None) -> list[tuple[str, int]]:
    """(name, layer) for every name in ARCHITECTURE.md's table (`| N | `mod`, `mod` | ... |`), in
    order, repeats kept (a name listed twice is an error the table check reports)."""
    text = (ROOT / "ARCHITECTURE.md").read_text() if text is None else text
    entries = []
    for line in text.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            entries += [(name, int(m.group(1))) for name in re.findall(r"`(lmforge[\w.]*)`", m.group(2))]
    return entries


def layers() -> dict[str, int]:
    """Folder (or top-level module) -> layer, from ARCHITECTURE.md's table."""
    return dict(table_entries())


def folder_of(module: str) -> str:
    """The folder a module belongs to (`lmforge.plan.layout` -> `lmforge.plan`), or the top-level
    module itself (`lmforge.folders`, `lmforge`): what the table gives a layer."""
    return ".".join(module.split(".")[:2])


def layer_of(module: str, table: dict[str, int]) -> int:
    """The layer of `module`'s folder."""
    folder = folder_of(module)
    assert folder in table, f"{folder} (of {module}) is in no layer of ARCHITECTURE.md"
    return table[folder]


def table_problems(entries: list[tuple[str, int]]) -> list[str]:
    """What keeps the table from giving each folder and top-level module exactly one layer: a name
    listed twice, a module inside a folder (a layer of its own would let it import above its
    folder), a name that is no module, a folder or top-level module left out."""
    problems = []
    folders = {folder_of(m) for m in MODULES}
    seen: dict[str, int] = {}
    for name, layer in entries:
        if name in seen:
            problems.append(f"{name} is listed twice (layers {seen[name]} and {layer})")
        seen[name] = layer
        if name not in MODULES:
            problems.append(f"{name} is no module of lmforge/")
        elif name not in folders:
            problems.append(f"{name} is a module of the folder {folder_of(name)}: the table gives folders "
                            f"layers; move the module to a folder of the layer it needs instead")
    problems += [f"{folder} is in no layer" for folder in sorted(folders - set(seen))]
    return problems


def _in_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


@functools.lru_cache(maxsize=None)
def imports_of(module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of `module` that names something."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if _in_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in MODULES else base, node.lineno))
    return found


def lmforge_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _ in imports_of(module):
            while target and target not in MODULES:  # `lmforge.x.y.Name` -> the module lmforge.x.y
                target = target.rpartition(".")[0]
            if target.startswith("lmforge") and target != module:
                edges[module].add(target)
    return edges


def folder_edges() -> dict[str, set[str]]:
    """The import graph between folders (and top-level modules): an edge where any module of one
    imports any module of the other."""
    edges: dict[str, set[str]] = {folder_of(m): set() for m in MODULES}
    for module, targets in lmforge_edges().items():
        edges[folder_of(module)] |= {folder_of(t) for t in targets} - {folder_of(module)}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    found = cycles(lmforge_edges())
    assert not found, f"import cycles: {found}"


def test_the_folders_import_each_other_without_a_cycle():
    """Two folders that import each other (even through different modules) are one concern split in
    two, or a module in the wrong folder; either way neither can be understood, tested or moved
    alone. The edges of each cycle name the modules that make them."""
    edges = folder_edges()
    found = cycles(edges)
    if found:
        module_edges = lmforge_edges()
        detail = [f"{m} -> {t}" for component in found for m in sorted(module_edges) for t in sorted(module_edges[m])
                  if folder_of(m) in component and folder_of(t) in component and folder_of(m) != folder_of(t)]
        pytest.fail(f"cycles between folders: {found}; through:\n" + "\n".join(detail))


def test_the_table_gives_each_folder_one_layer():
    problems = table_problems(table_entries())
    assert not problems, "ARCHITECTURE.md's layer table:\n" + "\n".join(problems)


def test_no_import_goes_up_a_layer():
    table = layers()
    assert len(set(table.values())) >= 5, "ARCHITECTURE.md's layer table was not found"
    bad = []
    for module in sorted(MODULES):
        mine = layer_of(module, table)
        for target, line in imports_of(module):
            if not target.startswith("lmforge"):
                continue
            while target not in MODULES:
                target = target.rpartition(".")[0]
            if layer_of(target, table) > mine:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {module} (layer {mine}) imports "
                           f"{target} (layer {layer_of(target, table)})")
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_layer_zero_needs_only_the_standard_library():
    """Layer 0 is what the planner and the config import before torch: standard library only."""
    table = layers()
    stdlib = sys.stdlib_module_names
    bad = [f"{m} imports {t}" for m in MODULES if layer_of(m, table) == 0
           for t, _ in imports_of(m) if t.split(".")[0] not in stdlib and layer_of_or_none(t, table) != 0]
    assert not bad, bad


def layer_of_or_none(module: str, table: dict[str, int]) -> int | None:
    return layer_of(module, table) if module.startswith("lmforge") else None


# (planted import) per check: a module cycle, an upward import, and a cycle between two folders of one
# layer through modules that make no module cycle (lmforge.ckpt.checkpointer already imports
# lmforge.parallel.mesh; lmforge.parallel.clip importing lmforge.ckpt.safe_io closes the folder cycle)
PLANTED = {
    "cycle": {"lmforge.folders": "lmforge.config.base", "lmforge.config.base": "lmforge.folders"},
    "upward": {"lmforge.config.base": "lmforge.train.trainer"},
    "folder cycle": {"lmforge.parallel.clip": "lmforge.ckpt.safe_io"},
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_the_checks_see_a_planted_violation(planted, monkeypatch):
    """The checks fail on a planted cycle / upward import / folder cycle (so they can fail at all)."""
    real = imports_of

    def fake(module: str) -> list[tuple[str, int]]:
        return real(module) + ([(PLANTED[planted][module], 1)] if module in PLANTED[planted] else [])

    monkeypatch.setattr(sys.modules[__name__], "imports_of", fake)
    if planted == "cycle":
        with pytest.raises(AssertionError, match="import cycles"):
            test_the_import_graph_has_no_cycle()
    elif planted == "upward":
        with pytest.raises(AssertionError, match="lmforge.train.trainer"):
            test_no_import_goes_up_a_layer()
    else:
        test_the_import_graph_has_no_cycle()  # no module cycle, and both folders in layer 3:
        test_no_import_goes_up_a_layer()  # only the folder check sees it
        with pytest.raises(pytest.fail.Exception, match=r"lmforge.parallel.clip -> lmforge.ckpt.safe_io"):
            test_the_folders_import_each_other_without_a_cycle()


@pytest.mark.parametrize("planted,problem", [
    ("| 4 | `lmforge.plan.layout` | a module of a folder in a layer of its own |", "a module of the folder"),
    ("| 0 | `lmforge.train` | a folder listed twice |", "listed twice"),
    ("| 0 | `lmforge.nowhere` | a stale name |", "no module"),
])
def test_the_table_check_sees_a_planted_violation(planted, problem):
    text = (ROOT / "ARCHITECTURE.md").read_text() + "\n" + planted + "\n"
    assert not table_problems(table_entries())
    assert any(problem in p for p in table_problems(table_entries(text)))
    left_out = [(name, layer) for name, layer in table_entries() if name != "lmforge.verify"]
    assert table_problems(left_out) == ["lmforge.verify is in no layer"]


# ---- one home for the loss ---------------------------------------------------------------------

LOSS_HOME = "lmforge.model.loss"
LOSS_NAMES = {"cross_entropy", "log_softmax", "nll_loss", "CrossEntropyLoss", "NLLLoss", "LogSoftmax"}


def loss_uses(source: str) -> list[int]:
    """Lines of `source` that name a cross-entropy / log-softmax / NLL function: a call or a
    reference (`F.cross_entropy(...)`, `x.log_softmax(-1)`, `torch.nn.NLLLoss`) or an import of one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.alias):
            name = node.name.rpartition(".")[2]
        else:
            continue
        if name in LOSS_NAMES:
            lines.append(node.lineno)
    return lines


def test_the_loss_is_written_only_in_model_loss():
    assert loss_uses(MODULES[LOSS_HOME].read_text()), "the check no longer sees lmforge.model.loss's own cross-entropy"
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}" for m in sorted(MODULES) if m != LOSS_HOME
           for line in loss_uses(MODULES[m].read_text())]
    assert not bad, ("cross-entropy / log-softmax outside lmforge/model/loss.py (use its token_nll_sum with "
                     "IGNORE_INDEX targets):\n" + "\n".join(bad))


def test_the_loss_check_sees_a_planted_violation():
    source = ('"""F.cross_entropy and log_softmax in a docstring do not count."""\n'
              "import torch.nn.functional as F\n"
              "from torch.nn.functional import nll_loss\n"
              "loss = F.cross_entropy(logits, targets)\n"
              "logp = logits.float().log_softmax(-1)\n")
    assert loss_uses(source) == [3, 4, 5]


# ---- no branch on the layout in the trainer ----------------------------------------------------

TRAINER = PACKAGE / "train" / "trainer.py"
# layout degrees and shapes, as config fields (cfg.parallel.*) and as DistInfo fields (self.dist.*)
LAYOUT_FIELDS = {"dp", "dp_replicate", "dp_shard", "cp", "tp", "pp", "zero_stage", "pp_schedule", "pp_virtual_stages",
                 "sequence_parallel", "dp_size", "dp_cp_size", "cp_size", "tp_size", "pp_size"}
# (function, cfg.parallel field) -> why the trainer may branch on it there
TRAINER_ALLOWED = {
    ("log_run_header", "async_sgd"): "a log line only: the batch line does not describe the parameter server's "
                                     "one-micro-batch updates, and AsyncSGDTrainer logs its own",
}


def layout_names() -> set[str]:
    """The layouts' names (`name = "ddp"`, `self.name = "zero1"` in lmforge/parallel)."""
    names = set()
    for path in (PACKAGE / "parallel").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str) and any(ast.unparse(t) in ("name", "self.name")
                                                                  for t in node.targets)):
                names.add(node.value.value)
    return names


def _conditions(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
        return [node.test]
    if isinstance(node, ast.comprehension):
        return list(node.ifs)
    if isinstance(node, ast.Match):
        return [node.subject]
    return []


def _function_of(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node.name
    return "<module>"


def layout_branches(source: str, allowed=TRAINER_ALLOWED) -> list[str]:
    """Where `source` branches on the parallel layout: a condition that reads `parallel.<field>`
    (but the allowed (function, field) pairs), a layout degree (`p.tp`, `self.dist.pp_size`) or
    `layout.<attr>`; or any comparison with a layout's name ("ddp", "fsdp", ...)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    names = layout_names()
    bad = []
    for node in ast.walk(tree):
        func = _function_of(node, parents)
        for test in _conditions(node):
            for a in ast.walk(test):
                if not isinstance(a, ast.Attribute):
                    continue
                owner = a.value.attr if isinstance(a.value, ast.Attribute) else getattr(a.value, "id", None)
                if ((owner == "parallel" and (func, a.attr) not in allowed) or owner == "layout"
                        or a.attr in LAYOUT_FIELDS):
                    bad.append(f"line {test.lineno} (in {func}): branches on {ast.unparse(a)}")
        if isinstance(node, ast.Compare):
            for c in ast.walk(node):
                if isinstance(c, ast.Constant) and c.value in names:
                    bad.append(f"line {node.lineno} (in {func}): compares with the layout name {c.value!r}")
    return bad


def test_the_trainer_does_not_branch_on_the_layout():
    bad = layout_branches(TRAINER.read_text())
    assert not bad, ("lmforge/train/trainer.py branches on the parallel layout; put what differs behind "
                     "lmforge.parallel.layout.Layout:\n" + "\n".join(bad))


PLANTED_BRANCHES = {
    "config field": "if self.cfg.parallel.pp > 1:\n        pass",
    "aliased section": "p = cfg.parallel\n    return 1 if p.tp > 1 else 2",
    "mesh degree": "while self.dist.pp_size > 1:\n        pass",
    "layout attribute": "if self.layout.gathers_for_eval:\n        pass",
    "layout name": "fsdp = self.layout.name in ('fsdp', 'zero1')",
    "allowed elsewhere only": "if not self.cfg.parallel.async_sgd:\n        pass",
}


@pytest.mark.parametrize("planted", sorted(PLANTED_BRANCHES))
def test_the_layout_check_sees_a_planted_violation(planted):
    assert {"ddp", "fsdp", "single"} <= layout_names()
    assert layout_branches(f"def step(self, cfg):\n    {PLANTED_BRANCHES[planted]}\n")
    if planted == "allowed elsewhere only":  # the allowlist is per function
        assert not layout_branches(f"def log_run_header(self, cfg):\n    {PLANTED_BRANCHES[planted]}\n")


# ---- the trainer stays a loop: its size, and no one extends it by patching -------------------------

TRAINER_MAX_LINES, LOOP_MAX_LINES, TRAINER_MAX_ATTRIBUTES = 500, 60, 25


def trainer_shape(source: str) -> tuple[int, int, set[str]]:
    """(lines of the module, lines of Trainer.train, the distinct `self.x = ...` names of Trainer)."""
    tree = ast.parse(source)
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    loop = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    attributes = set()
    for node in ast.walk(trainer):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    attributes.add(t.attr)
    return len(source.splitlines()), loop.end_lineno - loop.lineno + 1, attributes


def test_the_trainer_stays_small():
    """Issue 53's bounds: a new concern is a handler of lmforge.train.events, not trainer code."""
    lines, loop, attributes = trainer_shape(TRAINER.read_text())
    assert lines <= TRAINER_MAX_LINES, f"train/trainer.py has {lines} lines (at most {TRAINER_MAX_LINES}): move a concern into a handler"
    assert loop <= LOOP_MAX_LINES, f"Trainer.train has {loop} lines (at most {LOOP_MAX_LINES})"
    assert len(attributes) <= TRAINER_MAX_ATTRIBUTES, f"Trainer has {len(attributes)} attributes: {sorted(attributes)}"


def test_the_trainer_shape_check_counts_what_it_should():
    source = ("class Trainer:\n    def __init__(self):\n        self.a = 1\n        self.b, self.c = 2, 3\n"
              "        self.a += 1\n        self.d: int = 4\n    def train(self):\n        x = 1\n        return x\n")
    lines, loop, attributes = trainer_shape(source)
    assert (lines, loop, attributes) == (9, 3, {"a", "b", "c", "d"})


PATCHING = re.compile(r"monkeypatch\.setattr\([^)]*Trainer|Trainer\.[a-z_]+ *= ")


def test_nothing_extends_the_trainer_by_patching_its_methods():
    """Tests, benchmarks and lmforge itself extend the trainer through its events (handlers)."""
    bad = [f"{path.relative_to(ROOT)}:{i}" for folder in ("tests", "benchmarks", "lmforge")
           for path in sorted((ROOT / folder).rglob("*.py")) if path.resolve() != Path(__file__).resolve()
           for i, line in enumerate(path.read_text().splitlines(), 1) if PATCHING.search(line)]
    assert not bad, "the Trainer patched (add a handler: lmforge.train.events) at:\n" + "\n".join(bad)
    assert PATCHING.search('monkeypatch.setattr(Trainer, "update", fake)') and PATCHING.search("Trainer.update = f")
