"""The shell blocks README.md and docs/*.md mark runnable run as written, on CPU, in a fresh clone.

A fenced block whose info string is `bash runnable` (quick tier) or `bash runnable-full` (full
tier: a real launch, tens of seconds) is run by bash, every line, stopping at the first command
that fails, with the root of a fresh copy of the repository as its working directory: each
block on its own, so a runnable block needs nothing another block wrote. The once-per-clone
setup a line may start with (`python -m venv .venv`, activating it, `pip install ...`, joined by
`&&`) is left out: the environment the tests run in has done it. The convention is described
for writers in docs/architecture.md ("Docs that run").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from launching import REPO, TIMEOUT, launch_env

DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
QUICK, FULL = "runnable", "runnable-full"  # the info string's word after `bash`
SETUP_STEPS = ("python -m venv ", ". .venv/bin/activate", "source .venv/bin/activate", "pip install ")
FULL_TIMEOUT = 600  # the README's first command trains for 5 steps: 30-60 s on 2 cores
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    info: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def marker(self) -> str | None:
        words = self.info.split()
        return next((word for word in words[1:] if word.startswith("runnable")), None)


def fenced_blocks(doc: Path) -> list[Block]:
    """Every fenced block of a Markdown file, indented ones (in a list) included, dedented."""
    blocks: list[Block] = []
    opened: tuple[int, str, str, list[str]] | None = None  # line, indent, info, lines
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
        fence = FENCE.match(line)
        if opened is None:
            if fence:
                opened = (number, fence["indent"], fence["info"].strip(), [])
            continue
        if fence and not fence["info"].strip():
            start, _, info, body = opened
            blocks.append(Block(doc, start, info, "\n".join(body) + "\n"))
            opened = None
        else:
            indent = opened[1]
            opened[3].append(line[len(indent):] if line.startswith(indent) else line)
    return blocks


def runnable(marker: str) -> list[Block]:
    return [block for doc in DOCS for block in fenced_blocks(doc) if block.marker == marker]


def without_setup(text: str) -> str:
    """The block with each line's leading setup steps (`a && b && ...`) left out."""
    lines = []
    for line in text.splitlines():
        steps = line.split(" && ")
        while steps and steps[0].lstrip().startswith(SETUP_STEPS):
            steps.pop(0)
        lines.append(" && ".join(steps))
    return "\n".join(lines) + "\n"


def fresh_clone(dest: Path) -> Path:
    """The files a clone has (tracked, and new ones not ignored), copied to `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is no longer there
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def run_block(block: Block, root: Path, *, timeout: int) -> None:
    clone = fresh_clone(root / "clone")
    env = launch_env(root)
    # the clone is what runs (as `pip install -e .` in it would make it), through the `cpctl` command
    env |= {"PYTHONPATH": str(clone), "PATH": os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])}
    script = without_setup(block.text)
    try:
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=clone, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.where}: did not finish in {timeout} s:\n{script}\n{exc.stdout}\n{exc.stderr}")
    shown = f"{block.where}, run as:\n{script}\nexit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, shown
    assert "Traceback" not in done.stdout + done.stderr, shown


def test_the_markers_are_ones_this_test_runs() -> None:
    # a misspelt marker would leave its block unrun without a word
    marked = [block for doc in DOCS for block in fenced_blocks(doc) if "runnable" in block.info]
    assert marked, "no block of README.md or docs/*.md is marked runnable"
    for block in marked:
        assert block.info.split()[0] == "bash" and block.marker in (QUICK, FULL), \
            f"{block.where}: info string {block.info!r}; use `bash {QUICK}` or `bash {FULL}`"
    assert runnable(QUICK) and runnable(FULL)


def test_setup_steps_are_left_out_and_nothing_else() -> None:
    line = "python -m venv .venv && . .venv/bin/activate && pip install -e . && cpctl env && pip list"
    assert without_setup(line) == "cpctl env && pip list\n"
    assert without_setup("cpctl plan --model 1b --seq-len 4k\n") == "cpctl plan --model 1b --seq-len 4k\n"


@pytest.mark.parametrize("block", runnable(QUICK), ids=lambda block: block.where)
def test_a_runnable_block_runs_in_a_fresh_clone(block: Block, isolated: Path) -> None:
    run_block(block, isolated, timeout=TIMEOUT)


@pytest.mark.full
@pytest.mark.parametrize("block", runnable(FULL), ids=lambda block: block.where)
def test_a_long_runnable_block_runs_in_a_fresh_clone(block: Block, isolated: Path) -> None:
    run_block(block, isolated, timeout=FULL_TIMEOUT)
