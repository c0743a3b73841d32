"""README's API example runs as written (it is the first code a new user copies)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_api_example_runs(capsys):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    exec(compile(blocks[0], str(README), "exec"), {})
    assert "device_free_pages" in capsys.readouterr().out


def fresh_machine_commands(text: str) -> list[str]:
    """The command lines of the bash blocks in README's "On a fresh machine" section, in order."""
    section = text.split("## On a fresh machine\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line for b in blocks for line in b.splitlines() if line.strip()]


def test_ci_runs_exactly_readmes_commands():
    commands = fresh_machine_commands(README.read_text())
    assert commands[0] == (
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && hicache-jax bench"
    )
    assert commands[-1].endswith("&& python -m pytest -q -n auto --dist loadfile")
    ci = (README.parent / ".ci" / "run").read_text()
    assert re.findall(r"^run '(.*)'$", ci, flags=re.M) == commands
    # nothing else runs: every other line is a comment, the shell setup or run's definition
    others = [
        line for line in ci.splitlines() if line.strip() and not line.startswith(("#", "run '"))
    ]
    assert others == [
        "set -euo pipefail",
        'cd "$(dirname "$0")/.."',
        'run() { echo "+ $1"; bash -c "$1"; }',
    ]


def test_readme_test_command_installs_every_extra_the_tests_use():
    """The extras README's test command installs are all of pyproject's: none of the tests that
    need one is left to skip in CI."""
    pyproject = (README.parent / "pyproject.toml").read_text()
    table = pyproject.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([\w-]+) = \[", table, flags=re.M)
    assert extras, "no extras found in pyproject.toml"
    test_command = fresh_machine_commands(README.read_text())[-1]
    installed = re.search(r'pip install -e "\.\[([^\]]*)\]"', test_command).group(1).split(",")
    assert sorted(installed) == sorted(extras)
