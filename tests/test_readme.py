"""README's API example runs as written (it is the first code a new user copies)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_api_example_runs(capsys):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    exec(compile(blocks[0], str(README), "exec"), {})  # noqa: S102 - our own README
    assert "device_free_pages" in capsys.readouterr().out


def test_readme_commands_match_ci():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && python -m pytest -q' in text
    assert 'pip install -e ".[test]"\npython -m pytest -q' in ci
    assert "pip install -e . && hicache-jax bench" in text
