"""How a reader walks a run's configuration through the code (issue 35.4), read statically.

From ``fedcal.experiment.run_experiment``, each function's body is read in source order and
every call to a fedcal function is followed into its definition (pre-order, each function
once; names resolved through the modules' imports and re-exports). Prints the functions and
files read, the *re-entries* (the walk entering a file it had left) and the *climbs back
up* (re-entering a module that imports, directly or through others, the module just left:
back into a caller's module after descending), per file and per package.

    python benchmarks/config_walk.py [--src src/fedcal] [--most 8]

A call the reader cannot resolve statically (a method of an object, a callback) is not
followed; the figures compare trees read the same way, not every call a run makes.
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
from pathlib import Path

Key = tuple[str, str]  # (module, function or Class.method)


class Tree:
    """The modules of a source tree, their functions and imports."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mods: dict[str, tuple[Path, ast.Module]] = {}
        for p in root.rglob("*.py"):
            rel = p.relative_to(root.parent).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            self.mods[name] = (p, ast.parse(p.read_text()))

    def defs(self, mod: str) -> dict[str, ast.FunctionDef]:
        out = {}
        for n in self.mods[mod][1].body:
            if isinstance(n, ast.FunctionDef):
                out[n.name] = n
            elif isinstance(n, ast.ClassDef):
                for m in n.body:
                    if isinstance(m, ast.FunctionDef):
                        out[f"{n.name}.{m.name}"] = m
        return out

    def imports(self, mod: str, node: ast.AST | None = None) -> dict[str, tuple[str, str | None]]:
        """Name → (module, attribute) of the module's fedcal imports (and ``node``'s)."""
        out: dict[str, tuple[str, str | None]] = {}
        scopes = [self.mods[mod][1]] + ([node] if node is not None else [])
        for n in (x for scope in scopes for x in ast.walk(scope)):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fedcal"):
                out.update({a.asname or a.name: (n.module, a.name) for a in n.names})
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.startswith("fedcal"):
                        out[a.asname or a.name.split(".")[0]] = (a.name, None)
        return out

    def resolve(self, mod: str, name: str, depth: int = 0) -> Key | None:
        """The function a name of ``mod`` refers to, through re-exports."""
        if depth > 8 or mod not in self.mods:
            return None
        defs = self.defs(mod)
        if name in defs:
            return mod, name
        classes = {c.name for c in self.mods[mod][1].body if isinstance(c, ast.ClassDef)}
        if name in classes:
            return (mod, f"{name}.__init__") if f"{name}.__init__" in defs else None
        target = self.imports(mod).get(name)
        if target is None or target[1] is None or f"{target[0]}.{target[1]}" in self.mods:
            return None
        return self.resolve(target[0], target[1], depth + 1)

    def callees(self, key: Key) -> list[Key]:
        """The fedcal functions ``key`` calls, in source order."""
        mod, name = key
        node = self.defs(mod)[name]
        imports, cls = self.imports(mod, node), name.split(".")[0] if "." in name else None
        calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
        out = []
        for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
            target = self._target(mod, cls, imports, call.func)
            if target is not None:
                out.append(target)
        return out

    def _target(self, mod: str, cls: str | None, imports: dict, func: ast.AST) -> Key | None:
        if isinstance(func, ast.Name):
            if func.id in self.defs(mod):
                return mod, func.id
            origin = imports.get(func.id)
            return None if origin is None or origin[1] is None else self.resolve(*origin)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner == "self" and cls and f"{cls}.{func.attr}" in self.defs(mod):
                return mod, f"{cls}.{func.attr}"
            if owner in imports:
                m, attr = imports[owner]
                full = m if attr is None else f"{m}.{attr}"
                return self.resolve(full, func.attr) if full in self.mods else None
        return None

    def below(self) -> dict[str, set[str]]:
        """Per module, every fedcal module it imports, directly or through others."""
        direct: dict[str, set[str]] = {}
        for m, (_, tree) in self.mods.items():
            found = set()
            for n in ast.walk(tree):
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fedcal"):
                    found |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
                elif isinstance(n, ast.Import):
                    found |= {a.name for a in n.names}
            direct[m] = {d for d in found if d in self.mods and d != m}
        closure: dict[str, set[str]] = {}
        for m in direct:
            seen, todo = set(), list(direct[m])
            while todo:
                d = todo.pop()
                if d not in seen:
                    seen.add(d)
                    todo.extend(direct.get(d, ()))
            closure[m] = seen - {m}
        return closure


def walk(tree: Tree, callers: dict[Key, Key] | None = None) -> list[Key]:
    """The functions read from run_experiment, in reading order (pre-order, each once);
    ``callers`` (if given) receives each function's caller on the walk."""
    start = tree.resolve("fedcal.experiment", "run_experiment")
    order, seen, stack = [], set(), [(start, start)]
    while stack:
        key, caller = stack.pop()
        if key in seen:
            continue
        seen.add(key)
        order.append(key)
        if callers is not None:
            callers[key] = caller
        stack.extend((callee, key) for callee in reversed(tree.callees(key)))
    return order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=Path(__file__).parents[1] / "src/fedcal")
    parser.add_argument("--most", type=int, default=8)
    args = parser.parse_args()
    tree = Tree(args.src.resolve())
    callers: dict[Key, Key] = {}
    order = walk(tree, callers)
    files = [tree.mods[m][0].relative_to(tree.root).as_posix() for m, _ in order]
    starts = [i for i, f in enumerate(files) if i == 0 or f != files[i - 1]]
    path = [files[i] for i in starts]
    module = {tree.mods[m][0].relative_to(tree.root).as_posix(): m for m in tree.mods}
    below = tree.below()
    again, up, left = collections.Counter(), collections.Counter(), set()
    # a climb is a *return* when the function entered is called by one outside the module
    # just left (a caller further up the stack continuing with its next step), a *call up*
    # when a function of the module just left (or below it) calls into the upper module
    returns, calls_up = 0, []
    for i, f in enumerate(path):
        if f in left:
            again[f] += 1
            if module[path[i - 1]] in below[module[f]]:
                up[f] += 1
                caller = callers[order[starts[i]]][0]
                lower = module[path[i - 1]]
                if caller == lower or caller in below.get(lower, set()):
                    calls_up.append(f"{caller}.{callers[order[starts[i]]][1]}: {path[i - 1]} → {f}")
                else:
                    returns += 1
        if i:
            left.add(path[i - 1])
    packages = collections.Counter()
    for f, n in up.items():
        packages[f.split("/")[0].removesuffix(".py")] += n
    print(f"functions read: {len(order)}; files: {len(set(files))}")
    print(f"re-entries: {sum(again.values())}; most: {again.most_common(args.most)}")
    print(f"climbs back up: {sum(up.values())}; most: {up.most_common(args.most)}")
    print(f"  of which returns to a caller between its steps: {returns}; calls up: {calls_up}")
    print(f"climbs by package: {packages.most_common()}")


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    main()
