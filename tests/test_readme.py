"""README.md's recipes run: every ```python block is executed, so a recipe that
fails is a failing test (docs/api.md's blocks too).

Blocks run in README order in one namespace (a later block may use the names
of an earlier one). A block whose first line is ``# needs a CUDA GPU`` runs
only in the GPU test (after every block above it); every other python block
runs on the CPU, where NumPy inputs take the float64 reference path. A fence
in any other language than the ones listed in ``OTHER_LANGUAGES`` fails the
test, so that no Python recipe can hide from it under another name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
API_DOC = ROOT / "docs" / "api.md"
GPU_MARK = "# needs a CUDA GPU"
OTHER_LANGUAGES = ("bash", "text", "")
MAX_LINES = 250
# set-up, the main job and the test command must be seen without scrolling far
FIRST_LINES = 60

_FENCE = re.compile(r"^```(.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block of README.md."""

    language: str
    line: int  # README line of the block's first source line
    source: str

    @property
    def needs_gpu(self) -> bool:
        return self.source.splitlines()[0].strip() == GPU_MARK if self.source else False


def blocks(text: str, name: str = "README.md") -> list:
    """Every fenced block, in order (an unclosed fence is an error)."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start = i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{name}:{i + 1}: a fence that is never closed"
        found.append(Block(m.group(1).strip().lower(), start + 1, "\n".join(lines[start:end])))
        i = end + 1
    return found


def python_blocks(path: Path = README) -> list:
    return [b for b in blocks(path.read_text(), path.name) if b.language == "python"]


def run_blocks(chosen, path: Path = README) -> int:
    """Execute the blocks in one namespace; tracebacks name the file's lines."""
    ns = {"__name__": "__readme__"}
    for b in chosen:
        code = compile("\n" * (b.line - 1) + b.source, str(path), "exec")
        exec(code, ns)
    return len(chosen)


def test_every_block_is_cpu_or_gpu():
    """Each fence is python (run on the CPU or, marked, on the GPU) or a known
    non-Python language; a python block with a misspelt GPU mark fails."""
    all_blocks = blocks(README.read_text())
    for b in all_blocks:
        assert b.language == "python" or b.language in OTHER_LANGUAGES, (
            f"README.md:{b.line}: fence language {b.language!r}; use python (executed by "
            f"this test) or one of {OTHER_LANGUAGES}")
    py = [b for b in all_blocks if b.language == "python"]
    cpu = [b for b in py if not b.needs_gpu]
    gpu = [b for b in py if b.needs_gpu]
    assert cpu, "README.md has no python block that runs without a GPU"
    assert len(cpu) + len(gpu) == len(py)
    for b in cpu:
        first = b.source.splitlines()[0] if b.source else ""
        assert not (first.startswith("#") and re.search(r"\b(gpu|cuda)\b", first, re.I)), (
            f"README.md:{b.line}: first line {first!r} looks like a GPU mark; "
            f"write exactly {GPU_MARK!r} or the block runs on the CPU")


def test_cpu_blocks_run():
    """The blocks without the GPU mark, on the NumPy reference path."""
    cpu = [b for b in python_blocks() if not b.needs_gpu]
    assert run_blocks(cpu) == len(cpu) > 0


@pytest.mark.gpu
def test_all_blocks_run_on_the_gpu():
    """Every python block in order, the GPU-marked ones included."""
    py = python_blocks()
    assert any(b.needs_gpu for b in py)
    assert run_blocks(py) == len(py)


def test_api_doc_blocks_run():
    """docs/api.md's recipes (all of them run without a GPU)."""
    py = python_blocks(API_DOC)
    assert py and not any(b.needs_gpu for b in py)
    assert run_blocks(py, API_DOC) == len(py)


def test_readme_shape():
    """Issue 29's acceptance: short, no run ids or commit hashes, and set-up,
    the benchmark and the test command near the top."""
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"
    top = "\n".join(lines[:FIRST_LINES])
    for command in ('pip install -e ".[cuda12,test]"', "python -m benchmarks.bench"):
        assert command in top, f"{command!r} not within the first {FIRST_LINES} lines"
    assert re.search(r"^pytest$", top, re.M), f"'pytest' not within the first {FIRST_LINES} lines"
    run_ids = re.findall(r"`-\d*[a-z]`|\brun -\d*[a-z]\b|h100-20\d\d-\d\d-\d\d", text)
    assert not run_ids, f"run ids in README.md: {run_ids}"
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text)
              if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not hashes, f"commit hashes in README.md: {hashes}"


def test_local_links_exist():
    """Files and images the README links to are in the tree."""
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)\)", text)
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
