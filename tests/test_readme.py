"""The README's Python examples run as written (in order, sharing one namespace).

A block fenced as ```python no-test (multi-process or GPU-only code) is skipped.
"""

import pathlib
import re
import sys
import types

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # A real module: torch.compile looks the code's module up in sys.modules.
    module = types.ModuleType("ampfunc_readme_examples")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for i, block in enumerate(BLOCKS):
        exec(compile(block, f"README.md python block {i}", "exec"), module.__dict__)
