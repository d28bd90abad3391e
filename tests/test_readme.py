"""README.md: short, its two commands in CI's place, and every Python block runs as written.

Each ```python block runs alone in a fresh namespace (fence markers: tests/_helpers.py).
"""

import re

import pytest

from _helpers import ROOT, block_groups, doc_blocks, fence_problem, run_blocks

README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = doc_blocks(README)
GROUPS = block_groups(BLOCKS)


def test_readme_is_short():
    assert len(TEXT.splitlines()) <= 250


def test_readme_has_a_quickstart_and_a_gradscaler_migration_that_run():
    assert len(GROUPS) >= 2
    assert any("mixed_precision" in g[-1].code for g in GROUPS)
    assert any("compat.torch_amp import GradScaler" in g[-1].code for g in GROUPS)


def test_readme_fences_are_known():
    problems = [p for b in BLOCKS if (p := fence_problem(b))]
    assert not problems, problems


def test_the_first_bash_block_holds_the_two_commands_ci_runs():
    # .ci/run reads the second line of the first ```bash block and runs it in a fresh venv.
    first = re.search(r"^```bash\n(.*?)^```", TEXT, re.S | re.M)
    assert first, "README.md has no ```bash block"
    lines = first.group(1).strip().splitlines()
    assert len(lines) == 2, lines
    main_job, tests = lines
    assert "pip install" in main_job and "python -m ampfunc.examples." in main_job, main_job
    assert "pip install" in tests and re.search(r"(^|&& )(\S+=\S+ )*pytest ", tests), tests
    # Both installs are of one kind, so running the lines in order never silently swaps an
    # editable install for a normal one (or back).
    assert not any(re.search(r"pip install[^&]*\s-e\s", line) for line in lines), lines
    # No torch pin: the installed torch is kept.
    assert "torch==" not in first.group(1)


def test_readme_links_to_files_that_exist():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", TEXT)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, missing


@pytest.mark.parametrize("chain", GROUPS, ids=[f"line{g[-1].line}" for g in GROUPS])
def test_readme_block_runs(chain, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_blocks(chain, "ampfunc_readme_block")
