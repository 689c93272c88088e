"""docs/architecture.md's layering, held: the foundation it names imports nothing above it, only
``cli.py`` gathers the areas' command modules, and nothing outside the training code imports the
training stack when it is loaded (a login node runs every other command without torch)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "ctrain"
STACK = {"torch", "transformers", "trl", "datasets", "peft", "deepspeed", "accelerate", "bitsandbytes"}
TRAINING_CODE = ("train", "fast", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` is loaded: its module-level statements (not inside functions,
    which is where the commands import what they need), ``if TYPE_CHECKING`` blocks left out."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.Import):
                found |= {alias.name for alias in sub.names}
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                found.add(sub.module)
                found |= {f"{sub.module}.{alias.name}" for alias in sub.names}
    return found


def modules() -> dict[str, set[str]]:
    return {module_name(p): top_level_imports(p) for p in sorted(SRC.rglob("*.py"))}


def foundation() -> set[str]:
    """The foundation as docs/architecture.md names it."""
    text = (REPO / "docs" / "architecture.md").read_text()
    (listed,) = re.findall(r"the foundation \(([^)]*)\) imports nothing above", text)
    names = {name.strip().strip("`") for name in listed.replace("the package's", "").split(",")}
    return {"ctrain" if name == "__init__" else f"ctrain.{name}" for name in names}


def test_the_foundation_imports_nothing_above_it() -> None:
    base = foundation()
    assert {"ctrain", "ctrain.errors", "ctrain.proc", "ctrain.settings"} <= base, base
    found = modules()
    assert base <= set(found), base - set(found)
    # ``from ctrain import proc`` names the module ctrain.proc; ``from ctrain import install_hint`` a
    # name in the package itself: only names that are modules count.
    # A foundation package's own modules (ctrain.protocol.env) are the foundation too.
    below = base | {m for m in found if any(m.startswith(b + ".") for b in base)}
    above = {module: sorted(i for i in found[module] & set(found) if i not in below) for module in below}
    assert not {m: v for m, v in above.items() if v}, above


def test_only_the_root_cli_gathers_the_areas_commands() -> None:
    gatherers = {
        module
        for module, imports in modules().items()
        if any(re.fullmatch(r"ctrain\.\w+\.cli", i) for i in imports) and module != "ctrain.cli"
    }
    assert gatherers == set(), gatherers


def test_nothing_outside_the_training_code_loads_the_training_stack() -> None:
    """The image runs the training code; a login node or laptop runs the rest, without torch."""
    offenders = {
        module: sorted(i for i in imports if i.split(".")[0] in STACK)
        for module, imports in modules().items()
        if not module.startswith(tuple(f"ctrain.{area}" for area in TRAINING_CODE))
    }
    assert not {m: v for m, v in offenders.items() if v}, offenders


def every_import(path: Path) -> set[str]:
    """Every ctrain module ``path`` imports, at its top or inside a function (where commands import
    what they need), ``if TYPE_CHECKING`` blocks included: an import the table does not allow is one
    whichever place it hides in."""
    found: set[str] = set()
    for sub in ast.walk(ast.parse(path.read_text())):
        if isinstance(sub, ast.Import):
            found |= {alias.name for alias in sub.names}
        elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
            found.add(sub.module)
            found |= {f"{sub.module}.{alias.name}" for alias in sub.names}
    return found


def import_table() -> list[tuple[list[str], set[str] | None]]:
    """docs/architecture.md's module table: each row's modules (as module-name prefixes) and the ctrain
    modules it may import (None: everything)."""
    base = foundation()
    rows = []
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        match = re.match(r"^\| (`[^|]*`[^|]*) \| [^|]* \| ([^|]*) \|$", line)
        owners = re.findall(r"`([\w./]+)`", match[1]) if match else []
        if not match or not any(o.endswith((".py", "/")) for o in owners):
            continue
        prefixes = [f"ctrain.{o.rstrip('/')}" if o.endswith("/") else
                    "ctrain" if o == "__init__.py" else f"ctrain.{o.removesuffix('.py')}"
                    for o in owners if o.endswith((".py", "/"))]  # fmt: skip
        column = match[2]
        allowed = {"ctrain" if n == "install_hint" else f"ctrain.{n}" for n in re.findall(r"`([\w.]+)`", column)}
        rows.append((prefixes, None if column.startswith("everything") else allowed | (base if "foundation" in column
                                                                                        else set())))  # fmt: skip
    return rows


def _within(name: str, prefixes: set[str] | list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_each_module_imports_only_what_its_row_of_the_table_names() -> None:
    found = {module_name(p): every_import(p) for p in sorted(SRC.rglob("*.py"))}
    rows = import_table()
    assert len(rows) >= 20, rows
    unlisted = {m for m in found if not any(_within(m, prefixes) for prefixes, _ in rows)}
    assert not unlisted, f"modules with no row in docs/architecture.md's table: {sorted(unlisted)}"
    wrong = {}
    for prefixes, allowed in rows:
        if allowed is None:
            continue
        for module, imports in found.items():
            if not _within(module, prefixes):
                continue
            bad = {i for i in imports & set(found) if i != "ctrain" and not _within(i, prefixes) and not _within(i, allowed)}
            if bad:
                wrong[module] = sorted(bad)
    assert not wrong, f"imports that the module's row of docs/architecture.md does not name: {wrong}"


def test_the_table_check_finds_an_import_it_does_not_allow(tmp_path: Path) -> None:
    """The check above can fail: the foundation's errors.py importing a job module is caught."""
    (tmp_path / "errors.py").write_text("def f():\n    from ctrain.jobs import submit\n")
    imports = every_import(tmp_path / "errors.py")
    ((_, allowed),) = [(p, a) for p, a in import_table() if p == ["ctrain.errors"]]
    assert allowed is not None and "ctrain.jobs.submit" in imports and not _within("ctrain.jobs.submit", allowed)
