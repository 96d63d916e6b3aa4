import json

from drafttrain.cli import main
from drafttrain.corpus import function_prompts, stdlib_prompts

SOURCE = '''
import os

def setting(a, b):
    """Add two numbers and return the sum of them, carefully."""
    total = a + b
    return total

def short_doc(x):
    """Too short."""
    return x

class K:
    def method(self):
        """A method whose docstring is long enough to count here."""
        value = 1
        return value

@decorated
def skipped(y):
    """Decorated functions are skipped: the decorator is context we would cut."""
    z = y
    return z
'''


def test_function_prompts_cut_after_docstring():
    prompts = function_prompts(SOURCE)
    assert prompts == [
        'def setting(a, b):\n    """Add two numbers and return the sum of them, carefully."""\n',
        'def method(self):\n    """A method whose docstring is long enough to count here."""\n',
    ]


def test_stdlib_prompts_deterministic_and_unique(tmp_path):
    (tmp_path / "mod.py").write_text(SOURCE)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "mod.py").write_text(SOURCE.replace("documented", "in_tests"))
    rows = stdlib_prompts(10, seed=1, root=tmp_path)
    assert len(rows) == 2 and all(r["category"] == "stdlib" for r in rows)
    assert not any("in_tests" in r["prompt"] for r in rows)
    assert rows == stdlib_prompts(10, seed=1, root=tmp_path)


def test_cli_writes_prompt_file(tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    assert main(["assets", "stdlib", "--out", str(out), "--num", "25"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 25 and len({r["prompt"] for r in rows}) == 25
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
