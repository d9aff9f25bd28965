"""The design Notes and the code the docs name cannot go stale (no engine, no processes: text only).

* Every `[Note: X]` reference in zero3/, docs/, benchmarks/, tests/ and the README names a Note that is
  defined, and defined once. A definition is a comment (`# [Note: X]`) or a docstring line that is the
  Note's name alone, the heading of the text below it; anything else naming a Note is a reference. A
  reference that names its module (`zero3.step.optimizer's [Note: master views]`, `tags' [Note: x]`,
  or, in the docs, `` (`zero3/comm.py`, `[Note: x]`) ``) needs the Note defined in that module.
* Every code path the docs (docs/*.md, README.md, benchmarks/README.md) name in backticks exists:
  `zero3/passes/grad_reducer.py`, `engine/engine.py` (under zero3/ when it does not start at the
  repository's root), `gather_walk.py` (a file of that name somewhere in the code); `path.py:NAME` names
  something defined in that file. Every dotted `zero3.a.b` they name is a module, or a module and a name
  defined in it (`zero3.integrations.hf.Zero3Trainer`); every `` `Class.member` `` whose class zero3
  defines names a member of it.
* Every dotted `zero3.a.b` in a comment or docstring of zero3/ is a module, or a module and a name in it;
  every `` `Class.member` `` there whose class zero3 defines names a member of it.
* Where a text says which module or file holds a name, that module or file defines it (an import there
  is not enough): "zero3.checkpoint.tags' `FileSums`", "`Write` (zero3.checkpoint.tag_write)", and in the
  docs "`save_checkpoint` (`engine/checkpoints.py`, `checkpoint/state.py`)".
* The Note table of docs/architecture.md lists every Note zero3/ defines, at the file that defines it, and
  nothing else.

Each failure names the file, the line and what is missing.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("zero3", "tests", "benchmarks", "examples")
NOTE_DIRS = ("zero3", "docs", "benchmarks", "tests")
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ROOTED = ("zero3/", "tests/", "benchmarks/", "examples/", "docs/")
# zero3/config.py is becoming the package zero3/config/: either spelling names it.
PACKAGED = {"zero3/config.py": "zero3/config"}

# Stale names in files being rewritten by others just now, each to be fixed there (then dropped from here:
# an entry no longer needed fails the test too): (file, the name as written).

NOTE_START = "[Note:"
NOTE = re.compile(r"\[Note:\s+(?P<name>[^\[\]`\"]+?)\]")
DEFINITION = re.compile(r"^\[Note:\s+(?P<name>[^\[\]`\"]+?)\]$")
# What names a Note's module, just before it: "zero3.comm's ", "tags' ", "(`zero3/comm.py`, `".
DOTTED_OWNER = re.compile(r"(?<![\w.])(?P<owner>[A-Za-z_][\w.]*?)(?:'s|')\s*\(?$")
PATH_OWNER = re.compile(r"`(?P<path>[\w./-]+\.py)`,\s*`$")
DOTTED = re.compile(r"(?<![\w./-])zero3(?:\.[A-Za-z_]\w*)+(?P<dots>\.\.\.)?")
BACKTICKED = re.compile(r"`(?P<span>[^`\n]+)`")
PY_PATH = re.compile(r"(?<![\w./-])(?P<path>[\w-]+(?:/[\w.-]+)*\.py)(?::(?P<symbol>[A-Za-z_]\w*))?(?![\w/])")
DIR_PATH = re.compile(r"^(?P<path>[A-Za-z_]\w*(?:/\w+)*)/$")
MEMBER = re.compile(r"^(?P<cls>[A-Z]\w*)\.(?P<member>[A-Za-z_]\w*)(?:\(.*\))?$")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def files(dirs: tuple[str, ...], suffixes: tuple[str, ...]) -> list[Path]:
    found = [p for d in dirs for p in sorted((ROOT / d).rglob("*")) if p.suffix in suffixes and p.is_file()]
    return [p for p in found if "__pycache__" not in p.parts and p != Path(__file__).resolve()]


# ---- comments and docstrings ---------------------------------------------------------------------


@dataclass(frozen=True)
class Prose:
    """One line of a comment or docstring: its file, 1-based line, and text (without the `#`)."""

    path: Path
    line: int
    text: str


@cache
def prose(path: Path) -> tuple[Prose, ...]:
    """The comment lines and docstring lines of a Python file."""
    source = path.read_text()
    docstrings: set[tuple[int, int]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.add((first.lineno, first.col_offset))
    found: list[Prose] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append(Prose(path, token.start[0], token.string.lstrip("#").strip()))
        elif token.type == tokenize.STRING and token.start in docstrings:
            for offset, text in enumerate(token.string.splitlines()):
                found.append(Prose(path, token.start[0] + offset, text.strip().strip('"').strip("'").strip()))
    return tuple(found)


# ---- modules and the names they define -----------------------------------------------------------


def module_file(dotted: str) -> Path | None:
    """The file of module `dotted` (a package's __init__.py), or None."""
    base = ROOT.joinpath(*dotted.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def module_files(dotted: str) -> list[Path]:
    """Every file of module `dotted`: the module itself, or all of a package's."""
    base = ROOT.joinpath(*dotted.split("."))
    if base.with_suffix(".py").is_file():
        return [base.with_suffix(".py")]
    if (base / "__init__.py").is_file():
        return [p for p in sorted(base.rglob("*.py")) if "__pycache__" not in p.parts]
    return []


@cache
def top_level_names(path: Path) -> frozenset[str]:
    """The names a module defines or imports at its top level (through if/try/with blocks too)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(ast.parse(path.read_text()).body)
    return frozenset(names)


@cache
def defined_names(path: Path) -> frozenset[str]:
    """Every name a file itself defines, anywhere (`def NAME`, `class NAME`, `NAME =`, `NAME: T`,
    `self.NAME =`), not what it imports: a pointer to where something is must point at its definition."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
    return frozenset(names)


def resolve_dotted(dotted: str) -> str | None:
    """Why `zero3.a.b[.NAME]` does not resolve, or None: its longest module prefix must exist, and a name
    after it must be a submodule or a name that module defines."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is None:
            continue
        if cut == len(parts) or parts[cut] in top_level_names(path):
            return None
        return (f"no module {'.'.join(parts[:cut + 1])}, and {'.'.join(parts[:cut])} ({rel(path)}) defines no "
                f"{parts[cut]!r}")
    return f"no module {dotted}"


@cache
def code_basenames() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in files(CODE_DIRS, (".py",)):
        found.setdefault(path.name, []).append(path)
    return found


def resolve_path(path: str) -> list[Path]:
    """The files a docs path names (none when it names nothing): rooted at the repository (`zero3/...`,
    `tests/...`), else under zero3/, or, a bare file name, that name anywhere in the code."""
    if path in PACKAGED and (ROOT / PACKAGED[path] / "__init__.py").is_file():
        return [p for p in sorted((ROOT / PACKAGED[path]).rglob("*.py")) if "__pycache__" not in p.parts]
    if path.startswith(ROOTED) or path.startswith("./"):
        candidates = [ROOT / path]
    elif "/" in path:
        candidates = [ROOT / "zero3" / path]
    else:
        candidates = [ROOT / path, *code_basenames().get(path, [])]
    return [p for p in candidates if p.exists()]


@cache
def zero3_classes() -> dict[str, list[tuple[Path, ast.ClassDef]]]:
    found: dict[str, list[tuple[Path, ast.ClassDef]]] = {}
    for path in files(("zero3",), (".py",)):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append((path, node))
    return found


def class_members(path: Path, node: ast.ClassDef) -> set[str]:
    """What a class defines: methods, class attributes, `self.NAME =`, and its zero3 bases' members."""
    members: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(child.name)
        elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
            members.add(child.id)
        elif isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Store):
            members.add(child.attr)
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        for base_path, base_node in zero3_classes().get(name or "", []):
            if base_node is not node:
                members |= class_members(base_path, base_node)
    return members


def member_problem(span: str) -> str | None:
    """Why a backticked `Class.member` names nothing, or None (None too when zero3 defines no such class:
    torch's, transformers')."""
    member = MEMBER.match(span)
    if member is None or member["cls"] not in zero3_classes():
        return None
    owners = zero3_classes()[member["cls"]]
    if any(member["member"] in class_members(p, node) for p, node in owners):
        return None
    return f"{member['cls']} ({', '.join(rel(p) for p, _ in owners)}) has no {member['member']!r}"


# Where a text says which module or file defines a name: "zero3.checkpoint.tags' `FileSums`", "`Write`
# (zero3.checkpoint.tag_write)" (a class's name: a lower-case one there is as often an argument), and in the
# docs "`save_checkpoint` (`engine/checkpoints.py`, `checkpoint/state.py`)".
OWNED_BY_MODULE = (
    re.compile(r"(?<![\w.])(?P<module>zero3(?:\.\w+)+)(?:'s|') `(?P<name>[A-Za-z_]\w*)(?:\(.*?\))?`"),
    re.compile(r"`(?P<name>[A-Z]\w*)` \((?:see )?(?P<module>zero3(?:\.\w+)+)[)'; ,:]"),
)
OWNED_BY_PATHS = re.compile(r"`(?P<name>[A-Za-z_][\w.]*)(?:\(\))?` \((?P<paths>`[\w./-]+\.py`(?:, `[\w./-]+\.py`)*)\)")


def owned_problems(text: str, pages: bool) -> Iterator[str]:
    """Why a name a text says some module or file defines is not defined there (one line each)."""
    for pattern in OWNED_BY_MODULE:
        for match in pattern.finditer(text):
            found = module_files(match["module"])
            if found and not any(match["name"] in defined_names(p) for p in found):
                yield f"{match['module']} defines no {match['name']!r} (said of it: {match[0]!r})"
    if not pages:
        return
    for match in OWNED_BY_PATHS.finditer(text):
        found = [p for path in re.findall(r"`([^`]+)`", match["paths"]) for p in resolve_path(path)]
        first, _, member = match["name"].partition(".")
        if not found or (member and not first[0].isupper()):
            continue  # (a missing path is reported as such; `offload_optimizer.super_offload` is a key)
        if not member and not any(first in defined_names(p) for p in found):
            yield f"{match['paths']} define no {first!r}"
        elif member:
            classes = [(p, node) for p in found for q, node in zero3_classes().get(first, []) if q == p]
            if not classes:
                yield f"{match['paths']} define no class {first!r}"
            elif not any(member in class_members(p, node) for p, node in classes):
                yield f"{first} ({', '.join(rel(p) for p, _ in classes)}) has no {member!r}"


# ---- Notes ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    path: Path
    line: int
    name: str
    owner: str | None  # the module (dotted, a bare module name, or a path) the text says defines it


def continuation(text: str) -> str:
    return text.strip().lstrip("#").strip()


def note_references(path: Path) -> Iterator[Reference]:
    """Every `[Note: X]` in a file, a name wrapped over the next lines joined up, with the module just
    before it when the text names one."""
    lines = path.read_text().splitlines()
    for index, line in enumerate(lines):
        start = line.find(NOTE_START)
        while start != -1:
            text, more = line[start:], index + 1
            while "]" not in text and more < len(lines) and more <= index + 3:
                text += " " + continuation(lines[more])
                more += 1
            match = NOTE.match(text)
            if match is not None and match["name"].strip() != "...":
                before = (continuation(lines[index - 1]) if index else "") + " " + continuation(line[:start])
                owner = PATH_OWNER.search(before) or DOTTED_OWNER.search(before)
                yield Reference(path, index + 1, " ".join(match["name"].split()),
                                None if owner is None else owner.group(1))
            start = line.find(NOTE_START, start + 1)


@cache
def note_definitions() -> dict[str, list[tuple[Path, int]]]:
    """Each Note's definitions: (file, line) of every comment or docstring line that is `[Note: X]` alone."""
    found: dict[str, list[tuple[Path, int]]] = {}
    for path in files(("zero3", "tests", "benchmarks", "examples"), (".py",)):
        if NOTE_START not in path.read_text():
            continue  # (tokenizing is the slow part: only the files that name a Note)
        for line in prose(path):
            match = DEFINITION.match(line.text)
            if match is not None:
                found.setdefault(" ".join(match["name"].split()), []).append((path, line.line))
    return found


@cache
def owner_files(owner: str) -> list[Path] | None:
    """The files a reference's owner names, or None when the owner is not a module (\"the walk's\")."""
    if owner.endswith(".py"):
        return resolve_path(owner)
    if owner.startswith("zero3.") or owner == "zero3":
        return module_files(owner)
    if "." not in owner:
        named = [p for p in code_basenames().get(owner + ".py", []) if rel(p).startswith("zero3/")]
        package = [p for p in (ROOT / "zero3").rglob(owner) if (p / "__init__.py").is_file()]
        named += [f for pkg in package for f in sorted(pkg.rglob("*.py"))]
        return named or None
    return None


def note_problems() -> list[str]:
    defined = note_definitions()
    problems = [f"{rel(where[0][0])}:{where[0][1]}: [Note: {name}] is defined {len(where)} times "
                f"({', '.join(f'{rel(p)}:{n}' for p, n in where)})"
                for name, where in sorted(defined.items()) if len(where) > 1]
    definition_lines = {(path, line) for where in defined.values() for path, line in where}
    for path in files(NOTE_DIRS, (".py", ".md")) + [ROOT / "README.md"]:
        for ref in note_references(path):
            if (ref.path, ref.line) in definition_lines:
                continue
            where = defined.get(ref.name)
            if not where:
                problems.append(f"{rel(ref.path)}:{ref.line}: [Note: {ref.name}] is defined nowhere")
                continue
            if ref.owner is None:
                continue
            owned = owner_files(ref.owner)
            if owned is None:
                continue
            if not owned:
                problems.append(f"{rel(ref.path)}:{ref.line}: [Note: {ref.name}] is said to be {ref.owner}'s, "
                                f"and there is no such module")
            elif not any(p in owned for p, _ in where):
                problems.append(f"{rel(ref.path)}:{ref.line}: [Note: {ref.name}] is said to be {ref.owner}'s, "
                                f"but is defined at {', '.join(f'{rel(p)}:{n}' for p, n in where)}")
    return problems


def test_every_note_referenced_is_defined_where_it_is_said_to_be() -> None:
    problems = note_problems()
    assert not problems, "\n".join(problems)


# ---- code the docs name ---------------------------------------------------------------------------


def page_problems(page: Path) -> Iterator[str]:
    for number, line in enumerate(page.read_text().splitlines(), 1):
        where = f"{rel(page)}:{number}"
        for why in owned_problems(line, pages=True):
            yield f"{where}: {why}"
        for match in DOTTED.finditer(line):
            if match["dots"] is None:  # `zero3.safe_get_...` stands for a family
                why = resolve_dotted(match[0])
                if why is not None:
                    yield f"{where}: {match[0]}: {why}"
        for span_match in BACKTICKED.finditer(line):
            span = span_match["span"].strip()
            for path_match in PY_PATH.finditer(span):
                found = resolve_path(path_match["path"])
                if not found:
                    yield f"{where}: {path_match['path']} does not exist"
                elif path_match["symbol"] and not any(path_match["symbol"] in defined_names(p) for p in found):
                    yield f"{where}: {path_match['path']} defines no {path_match['symbol']!r}"
            directory = DIR_PATH.match(span)
            if directory is not None:
                top = directory["path"].split("/")[0]
                if f"{top}/" in ROOTED and not (ROOT / directory["path"]).is_dir():
                    yield f"{where}: {span} does not exist"
                elif f"{top}/" not in ROOTED and (ROOT / "zero3" / top).is_dir() \
                        and not (ROOT / "zero3" / directory["path"]).is_dir():
                    yield f"{where}: zero3/{span} does not exist"
            why = member_problem(span)
            if why is not None:
                yield f"{where}: {why}"


def test_every_path_and_module_the_docs_name_exists() -> None:
    problems = [problem for page in PAGES for problem in page_problems(page)]
    assert not problems, "\n".join(problems)


def test_every_module_and_member_the_code_comments_name_exists() -> None:
    problems = []
    for path in files(("zero3",), (".py",)):
        if "`" not in path.read_text() and not any(
                DOTTED.search(line) and not line.lstrip().startswith(("import ", "from "))
                for line in path.read_text().splitlines()):
            continue  # nothing to check outside the imports (tokenizing is the slow part)
        for line in prose(path):
            for match in DOTTED.finditer(line.text):
                if match["dots"] is None:
                    why = resolve_dotted(match[0])
                    if why is not None:
                        problems.append(f"{rel(path)}:{line.line}: {match[0]}: {why}")
            for span in BACKTICKED.finditer(line.text):
                why = member_problem(span["span"].strip())
                if why is not None:
                    problems.append(f"{rel(path)}:{line.line}: {why}")
            problems += [f"{rel(path)}:{line.line}: {why}" for why in owned_problems(line.text, pages=False)]
    assert not problems, "\n".join(problems)


# ---- the Note table -------------------------------------------------------------------------------

TABLE_ROW = re.compile(r"^\| (?P<name>[^|]+?) \| `(?P<file>[^`|]+)` \| (?P<short>[^|]+) \|$")


def test_the_architecture_note_table_lists_every_note() -> None:
    page = ROOT / "docs" / "architecture.md"
    rows = {}
    problems = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        row = TABLE_ROW.match(line)
        if row is not None and row["name"] != "Note":
            if row["name"] in rows:
                problems.append(f"{rel(page)}:{number}: the Note table lists {row['name']!r} twice")
            rows[row["name"]] = (number, row["file"])
    assert rows, f"{rel(page)} has no Note table"
    defined = {name: where for name, where in note_definitions().items()
               if any(rel(p).startswith("zero3/") for p, _ in where)}
    for name, where in sorted(defined.items()):
        files_there = sorted({rel(p).removeprefix("zero3/") for p, _ in where})
        if name not in rows:
            problems.append(f"{rel(page)}: the Note table lacks [Note: {name}] ({', '.join(files_there)})")
        elif rows[name][1] not in files_there:
            problems.append(f"{rel(page)}:{rows[name][0]}: the Note table puts [Note: {name}] in "
                            f"{rows[name][1]}; it is defined in {', '.join(files_there)}")
    for name, (number, _) in sorted(rows.items()):
        if name not in defined:
            problems.append(f"{rel(page)}:{number}: the Note table lists [Note: {name}], which zero3/ does not define")
    assert not problems, "\n".join(problems)


# ---- the checks catch what they are for -----------------------------------------------------------


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('"""A module.\n\n[Note: a heading]\nText (see [Note: a\n    wrapped one]).\n"""\n'
                      "# zero3.comm's [Note: the engine's groups] and tags' [Note:\n# checksums]\n")
    refs = list(note_references(sample))
    assert [(r.line, r.name, r.owner) for r in refs] == [
        (3, "a heading", None), (4, "a wrapped one", None), (7, "the engine's groups", "zero3.comm"),
        (7, "checksums", "tags")]
    definitions = [(line.line, line.text) for line in prose(sample) if DEFINITION.match(line.text)]
    assert definitions == [(3, "[Note: a heading]")]
    assert resolve_dotted("zero3.checkpoint.tags") is None
    assert resolve_dotted("zero3.integrations.hf.Zero3Trainer") is None
    assert resolve_dotted("zero3.checkpoint.no_such_module") is not None
    assert resolve_dotted("zero3.comm.no_such_name") is not None
    assert resolve_path("passes/grad_reducer.py") and resolve_path("gather_walk.py")
    assert resolve_path("zero3/config.py") and resolve_path("zero3/config/") and module_files("zero3.config")
    assert not resolve_path("runtime/no_such_file.py")
    page = tmp_path / "page.md"
    page.write_text("`runtime/no_such.py` `zero3/comm.py:no_such_name` `zero3/comm.py:Communicator` "
                    "`GradReduce.no_such_member` `GradReduce.start` zero3.no_such zero3.safe_get_...\n")
    problems = list(page_problems(page))
    assert len(problems) == 4 and all(p.startswith(f"{page}:1: ") for p in problems), problems
    assert owner_files("zero3.no_such") == [] and owner_files("walk") is None
    assert not list(owned_problems("zero3.checkpoint.tags' `FileSums` and `Write` (zero3.checkpoint.tag_write)", False))
    assert len(list(owned_problems("`Write` (zero3.checkpoint.state): imported there, defined elsewhere", False))) == 1
    assert not list(owned_problems("`save_checkpoint` (`engine/checkpoints.py`, `checkpoint/state.py`), "
                                   "`offload_optimizer.super_offload` (`early_step.py`)", True))
    assert len(list(owned_problems("`ZeroOptimizer.no_such` (`step/optimizer.py`)", True))) == 1
