"""examples/notebooks/policy_study.ipynb: stored without outputs; run top to bottom at its
small size (what CI does) without a cell error, its replay figures equal those of the
``hicache-jax replay`` command it prints."""

import importlib.util
import json
import pathlib
import shlex
import time

import pytest

from hicache_jax import study
from hicache_jax.cli.main import main

NOTEBOOK = (
    pathlib.Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "policy_study.ipynb"
)
_NEEDS = ("nbclient", "nbformat", "ipykernel", "pandas", "matplotlib")
_MISSING = [m for m in _NEEDS if importlib.util.find_spec(m) is None]


def test_notebook_is_stored_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "no code cell"
    assert [c["outputs"] for c in code] == [[]] * len(code)
    assert {c["execution_count"] for c in code} == {None}
    assert "widgets" not in nb["metadata"]  # no saved widget state either


def _stdout(cell) -> str:
    return "".join(
        o["text"]
        for o in cell.get("outputs", [])
        if o["output_type"] == "stream" and o["name"] == "stdout"
    )


@pytest.mark.skipif(
    bool(_MISSING),
    reason=f'running the notebook needs {", ".join(_MISSING)}: pip install -e ".[notebook]"',
)
def test_notebook_runs_and_its_figures_equal_the_replay_commands(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    saved = tmp_path / "sweep.json"
    monkeypatch.setenv("POLICY_STUDY_SMALL", "1")
    monkeypatch.setenv("POLICY_STUDY_SAVE", str(saved))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    t0 = time.perf_counter()
    # raises CellExecutionError (the cell and its traceback) on any cell error
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    print(f"notebook ran in {time.perf_counter() - t0:.1f} s")
    commands = [
        line
        for c in nb.cells
        for line in _stdout(c).splitlines()
        if line.startswith("hicache-jax replay ")
    ]
    assert len(commands) == 1
    path = tmp_path / "replay.json"
    argv = shlex.split(commands[0])[1:] + ["--quiet", "--json", str(path)]
    assert main(argv) == 0
    assert study.from_json(path).records(timing=False) == study.from_json(saved).records(
        timing=False
    )
    shown = nb.cells[-2].outputs[-1]["data"]["text/plain"]  # the TTFT table
    assert all(name in shown for name in ("no cache", "device radix", "hicache"))
