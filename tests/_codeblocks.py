"""The Python blocks of the README and of the documentation pages, and how the tests run them.

Fence conventions (docs/contributing/docs.md):

- ```python                 runs as it is, alone, in a fresh namespace;
- ```python continued       runs in the namespace the previous blocks of its page left; the page
                            says so in its text ("continues the block before it");
- ```python no-test         is not run (it needs a GPU or several processes);
- ```python recipe=<pkg>    is run by tests/test_recipes.py when <pkg> imports.
"""

import re
import sys
import types
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
CONTINUED_PHRASE = "continues the block before it"
_FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```\s*$", re.S | re.M)


class Block(NamedTuple):
    page: str   # path relative to the repository root
    index: int  # 0-based among the page's python blocks
    line: int   # 1-based line of the opening fence
    info: str   # what follows "python" on the fence line, stripped
    code: str


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    rel = str(path.relative_to(ROOT))
    return [Block(rel, i, text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2))
            for i, m in enumerate(_FENCE.finditer(text))]


def fence_problem(block: Block) -> str | None:
    info = block.info
    if info in ("", "continued", "no-test") or re.fullmatch(r"recipe=\w+", info):
        return None
    return f"{block.page}:{block.line}: unknown fence marker ```python {info}"


def runnable(block: Block) -> bool:
    return block.info in ("", "continued")


def groups(page_blocks: list[Block]) -> list[list[Block]]:
    """Each runnable block with the blocks it continues (a block marked `continued` runs after
    every runnable block of its page before it, back to the last one that is not)."""
    out, chain = [], []
    for b in page_blocks:
        if not runnable(b):
            continue
        chain = chain + [b] if b.info == "continued" else [b]
        out.append(list(chain))
    return out


def run(chain: list[Block], name: str) -> dict:
    """Runs the blocks of ``chain`` in order in one fresh module namespace; returns it."""
    # A real module: torch.compile looks the code's module up in sys.modules.
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        for b in chain:
            exec(compile(b.code, f"{b.page}:{b.line}", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module.__dict__
