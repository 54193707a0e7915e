"""The torch APIs lmforge's code uses, found by reading its source (not a hand-kept list), and which of
them the running torch lacks: the GPU suite's `env` row, so a gap in the GPU machine's older torch is
named up front, not met as a traceback mid-run.

    python benchmarks/gpu/torch_apis.py [--json]     # check this interpreter's torch against lmforge/

What counts as a use (Python's `ast`, every module under lmforge/): `from torch.x import name`,
`import torch.x [as y]`, and every attribute chain rooted at a name bound to torch or one of its
modules (`torch.nn.functional.silu`, `F.silu` after `import torch.nn.functional as F`,
`dist.all_reduce`, `nn.Linear` after `from torch import nn`, `getattr(torch, "name")`). A chain ends at
a call or a subscript:
`torch.cuda.get_device_properties(0).total_memory` checks `torch.cuda.get_device_properties`.

A use the code is ready to miss is *feature-detected*: inside a `try` whose handlers catch
ImportError / AttributeError, or tested in the same file with `hasattr(torch.x, "name")`
or `getattr(torch.x, "name", default)`. Such a name missing is reported, not an error (the code falls back).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUARDS = {"ImportError", "ModuleNotFoundError", "AttributeError"}  # (a broad except reports errors: no guard)


@dataclass
class Use:
    name: str  # dotted, rooted at torch: "torch.nn.functional.silu"
    files: set[str] = field(default_factory=set)
    guarded: bool = True  # every use of it is feature-detected (one plain use makes it required)


def _catches_guard(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:  # a bare except: error handling, not a feature test
        return False
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in GUARDS or isinstance(n, ast.Attribute) and n.attr in GUARDS
               for n in names)


class _FileScan(ast.NodeVisitor):
    """One module's torch uses: aliases from its imports, then the attribute chains through them."""

    def __init__(self, source: str):
        self.tree = ast.parse(source)
        self.aliases: dict[str, str] = {}  # local name -> dotted torch name
        self.uses: dict[str, bool] = {}  # dotted name -> guarded (all uses so far)
        self._guard_depth = 0
        for node in ast.walk(self.tree):  # aliases first: a function may use a name imported further down
            self._bind(node)
        # hasattr(torch.x, "y") / getattr(torch.x, "y", default) anywhere in the file: torch.x.y is
        # feature-detected here; getattr(torch.x, "y") without a default is a plain use
        self.detected: set[str] = set()
        for c in ast.walk(self.tree):
            if (isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in ("hasattr", "getattr")
                    and len(c.args) >= 2 and isinstance(c.args[1], ast.Constant) and isinstance(c.args[1].value, str)):
                base = self._dotted(c.args[0])
                if base is not None:
                    name = f"{base}.{c.args[1].value}"
                    if c.func.id == "hasattr" or len(c.args) == 3:
                        self.detected.add(name)
                    else:
                        self.uses[name] = False
        self.visit(self.tree)

    def _dotted(self, node: ast.AST) -> str | None:
        """The torch name an expression of names and attributes stands for, or None."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return ".".join([self.aliases[node.id], *reversed(parts)])
        return None

    def _bind(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    # `import torch.x.y` binds `torch`; `import torch.x.y as z` binds z to torch.x.y
                    self.aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                if a.name != "*":
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def _add(self, name: str) -> None:
        guarded = self._guard_depth > 0 or name in self.detected
        self.uses[name] = self.uses.get(name, True) and guarded

    def visit_Try(self, node: ast.Try) -> None:
        guarded = any(_catches_guard(h) for h in node.handlers)
        self._guard_depth += guarded
        for stmt in node.body:
            self.visit(stmt)
        self._guard_depth -= guarded
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.startswith("torch."):
                self._add(a.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module and (node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                self._add(node.module if a.name == "*" else f"{node.module}.{a.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self._dotted(node)
        if name is not None:
            self._add(name)
            return  # (the inner attributes are prefixes of this chain: a prefix resolves when it does)
        self.generic_visit(node)


def scan(package: Path = ROOT / "lmforge") -> dict[str, Use]:
    """Every torch name the modules under `package` use, with the files using it."""
    uses: dict[str, Use] = {}
    for path in sorted(package.rglob("*.py")):
        found = _FileScan(path.read_text())
        for name, guarded in found.uses.items():
            use = uses.setdefault(name, Use(name))
            use.files.add(str(path.relative_to(package.parent)))
            use.guarded = use.guarded and guarded
    return uses


def resolves(name: str) -> bool:
    """Whether `name` (dotted, from torch) exists in this interpreter's torch: attribute by attribute,
    importing a submodule where an attribute is not there yet (torch.distributed.checkpoint.staging)."""
    parts = name.split(".")
    try:
        obj = importlib.import_module(parts[0])
    except ImportError:
        return False
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except ImportError:
            return False
    return True


def check(uses: dict[str, Use]) -> dict:
    """{"checked": n, "missing": required names absent, "missing_detected": feature-detected names absent}."""
    absent = [u for name, u in sorted(uses.items()) if not resolves(name)]
    return {"checked": len(uses), "missing": [u.name for u in absent if not u.guarded],
            "missing_detected": [u.name for u in absent if u.guarded],
            "where": {u.name: sorted(u.files) for u in absent}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--package", type=Path, default=ROOT / "lmforge", help="the source tree to read (default lmforge/)")
    args = p.parse_args(argv)
    res = check(scan(args.package))
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['checked']} torch names used under {args.package}; missing: {res['missing'] or 'none'}; "
              f"missing but feature-detected: {res['missing_detected'] or 'none'}")
    return 1 if res["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
