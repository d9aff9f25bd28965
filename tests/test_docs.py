"""The README and docs/ cannot go stale: their code runs, their commands exist, their links resolve.

* Every ```python block of a page runs. A page's runnable blocks are one script, in page order (a later
  block sees the names an earlier one made, as a reader reads them), run in a fresh directory on the CPU
  as `__main__` (`runpy`): at world 1 in one process with no launcher's variables, as plain `python` runs
  it, or in 2 ranks with torchrun's variables when the page says `<!-- docs-test: world 2 -->`. The
  processes are forked from the suite's preloaded server (tests.distributed), which saves each page the
  seconds a fresh interpreter spends importing torch and zero3. A block that cannot run here is marked on
  the line before its fence with `<!-- docs-test: skip: <why> -->`; the reason is required.
* Every command in a ```bash block names something that exists: a `zero3` subcommand, a script in the
  repository (`python`, `torchrun`, `accelerate launch`, `bash`), or a module `python -m` can import.
* Every relative link names a file that exists and, with `#anchor`, one of its headings.
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.distributed import RENDEZVOUS_VARIABLES, run_ranks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARKER = re.compile(r"^<!-- docs-test: skip: (?P<reason>.*?) -->$")
WORLD_MARKER = re.compile(r"^<!-- docs-test: world (?P<world>\d+) -->$", re.MULTILINE)
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)|!\[[^\]]*\]\((?P<image>[^)\s]+)\)")
PAGE_SECONDS = 180

# Shell words that start a command and need no check of their own (plain shell, package tools).
PLAIN_COMMANDS = {"cd", "export", "pip", "pip3", "git", "ls", "cat", "cp", "mv", "mkdir", "rm", "source", "echo", "tail",
                  "nvidia-smi", "uv", "conda", "kill", "sleep", "wait", "du", "mount", "umount",
                  "torchft_lighthouse"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's line, 1-based
    lang: str
    text: str
    skip_reason: str | None


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, with the skip marker each carries."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        marker = SKIP_MARKER.match(lines[index - 1].strip()) if index > 0 else None
        found.append(Block(page, index + 1, opening["lang"], "\n".join(lines[index + 1:end]),
                           marker["reason"].strip() if marker else None))
        index = end + 1
    return found


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def test_every_skip_marker_gives_a_reason_and_precedes_a_block() -> None:
    problems = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if "docs-test:" not in line or WORLD_MARKER.match(line.strip()):
                continue
            marker = SKIP_MARKER.match(line.strip())
            following = lines[number] if number < len(lines) else ""
            if marker is None or not marker["reason"].strip() or FENCE.match(following) is None:
                problems.append(f"{page_id(page)}:{number}: {line.strip()!r} (expected "
                                "'<!-- docs-test: skip: <why> -->' on the line right before a block's fence)")
    assert not problems, "\n".join(problems)


def script_for(page: Path) -> str | None:
    """A page's runnable python blocks as one script; each block starts with a line naming where it is."""
    runnable = [block for block in blocks(page) if block.lang == "python" and block.skip_reason is None]
    if not runnable:
        return None
    parts = [f"# --- {page_id(page)}:{block.line}\n{block.text}\n" for block in runnable]
    return "\n".join(parts)


RUNNABLE_PAGES = [page for page in PAGES if script_for(page) is not None]


def run_page(rank: int, world: int, script: str, cwd: str) -> None:
    """One rank of a page's script, as `python script` (world 1) or torchrun's worker (world 2) runs it."""
    if world == 1:
        for name in RENDEZVOUS_VARIABLES:  # no launcher: the page makes its own world of one
            os.environ.pop(name, None)
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    os.chdir(cwd)
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")


@pytest.mark.timeout(PAGE_SECONDS)
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=page_id)
def test_the_python_blocks_of_a_page_run(page: Path, tmp_path: Path) -> None:
    script = tmp_path / "page.py"
    script.write_text(script_for(page) or "")
    declared = WORLD_MARKER.search(page.read_text())
    world = int(declared["world"]) if declared else 1
    try:
        run_ranks(world, run_page, str(script), str(tmp_path))
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as failure:  # raised, or exited (sys.exit)
        pytest.fail(f"{page_id(page)}'s python blocks failed at world {world}; the '# --- page:line' comments of "
                    f"{script} say which block a line is in:\n{failure}")


def zero3_subcommands() -> set[str]:
    from zero3.cli import build_parser

    parser = build_parser()
    for action in parser._actions:  # argparse keeps its subcommands only here
        if action.dest == "command":
            return set(action.choices)  # type: ignore[arg-type]
    raise AssertionError("zero3's parser has no subcommands")


def commands_in(text: str) -> list[list[str]]:
    """The simple commands of a shell block: continuations joined, comments dropped, split at && || ; |."""
    joined = re.sub(r"\\\n", " ", text)
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in [*words, "&&"]:
            if word in {"&&", "||", ";", "|", "&"}:
                if current:
                    found.append(current)
                current = []
            else:
                current.append(word)
    return found


def problem_with(command: list[str], subcommands: set[str]) -> str | None:
    words = list(command)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value prefixes
        words.pop(0)
    if words and words[0] in {"env", "timeout", "time", "nohup", "sudo"}:
        words.pop(0)
        while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0].replace(".", "").isdigit()):
            words.pop(0)
    if not words:
        return None
    program, rest = words[0], words[1:]
    if program in PLAIN_COMMANDS:
        return None
    if program == "zero3":
        sub = next((word for word in rest if not word.startswith("-")), None)
        return None if sub in subcommands else f"zero3 has no subcommand {sub!r} (it has {sorted(subcommands)})"
    if program in {"python", "python3"} and rest[:1] == ["-m"]:
        module = rest[1] if len(rest) > 1 else ""
        return None if importlib.util.find_spec(module) is not None else f"python -m {module}: no such module"
    if program in {"python", "python3", "torchrun", "bash", "accelerate"}:
        scripts = [word for word in rest if word.endswith((".py", ".sh"))]
        if not scripts:
            return f"{program} names no script"
        missing = [word for word in scripts if not (ROOT / word).is_file()]
        return f"no such script: {missing[0]}" if missing else None
    return f"unknown command {program!r} (name a zero3 subcommand or a script in the repository)"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_shell_command_names_what_exists(page: Path) -> None:
    subcommands = zero3_subcommands()
    problems = []
    for block in blocks(page):
        if block.lang not in {"bash", "sh", "shell", "console"}:
            continue
        for command in commands_in(block.text):
            problem = problem_with(command, subcommands)
            if problem:
                problems.append(f"{page_id(page)}:{block.line}: `{shlex.join(command)}`: {problem}")
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    inside_code = False
    found = set()
    for line in page.read_text().splitlines():
        if FENCE.match(line) or line.strip() == "```":
            inside_code = not inside_code
        elif not inside_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page: Path) -> None:
    problems = []
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    for match in LINK.finditer(text):
        target = match["target"] or match["image"]
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            problems.append(f"{page_id(page)}: [{target}]: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{page_id(page)}: [{target}]: no heading with that anchor in {linked.name}")
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The parsers above find a bad block, command and link (so a passing run means something)."""
    page = tmp_path / "page.md"
    page.write_text("# T\n\n<!-- docs-test: skip: needs a GPU -->\n```python\nraise SystemExit(1)\n```\n\n"
                    "```python\nx = 1\n```\n\n```bash\nzero3 nosuch --x\npython examples/nope.py\n"
                    "FOO=1 torchrun --nproc_per_node 2 examples/hf_trainer.py && python -m pytest -q\n```\n\n"
                    "[a](missing.md) [b](#t) [c](#nope)\n\n## A `code`_name, here?\n")
    found = blocks(page)
    assert [(block.lang, block.skip_reason) for block in found] == [
        ("python", "needs a GPU"), ("python", None), ("bash", None)]
    assert "raise SystemExit" not in (script_for(page) or "") and "x = 1" in (script_for(page) or "")
    subcommands = zero3_subcommands()
    verdicts = [problem_with(command, subcommands) for command in commands_in(found[2].text)]
    assert verdicts[0] is not None and "nosuch" in verdicts[0]
    assert verdicts[1] is not None and "examples/nope.py" in verdicts[1]
    assert verdicts[2:] == [None, None]
    assert anchors(page) == {"t", "a-code_name-here"}


def test_the_figure_tables_are_what_the_measured_json_says() -> None:
    """docs/benchmarks.md and the README's headline table are benchmarks/figures.py's output, unedited."""
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    assert spec is not None and spec.loader is not None
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    assert figures.main(["--check"]) == 0, "run python benchmarks/figures.py to rewrite the tables from the JSON"
