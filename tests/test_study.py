"""hicache_jax.study: traces by path or name, the sweep's figures equal ``hicache-jax replay``'s,
the result's JSON round trip, its table with and without pandas, its plot with and without
matplotlib, bad settings refused before anything is replayed."""

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hicache_jax import KVSpec, study
from hicache_jax.cli.main import main

DATA = pathlib.Path(__file__).parent / "data"
SYNTHETIC = DATA / "mooncake_synthetic_300.jsonl"
TOKENS = DATA / "tokens_small.jsonl"
SETTINGS = dict(capacities=[1e5, 3e5], policies=["clean_ahead", "write_back"])


@pytest.fixture(scope="module")
def small():
    """A sweep of the synthetic slice's first 60 requests (two L1 sizes, two policies)."""
    return study.sweep(study.load_trace(SYNTHETIC, limit=60), progress=False, **SETTINGS)


# ------------------------------------------------------------------------------------ traces


def test_load_trace_by_path_by_name_and_as_is():
    by_path = study.load_trace(SYNTHETIC, limit=5)
    for name in ("mooncake_synthetic_300", "mooncake_synthetic_300.jsonl"):
        by_name = study.load_trace(name, limit=5)
        assert by_name.path == str(SYNTHETIC.resolve())
        assert [r.tokens().tolist() for r in by_name.requests] == [
            r.tokens().tolist() for r in by_path.requests
        ]
    assert study.load_trace(by_path) is by_path
    assert study.load_trace("tokens_small").format == "tokens"
    names = study.shipped_traces()
    assert {"mooncake_synthetic_1000", "mooncake_conversation_300", "tokens_small"} <= set(names)


def test_trace_folders_of_the_environment_are_searched_first(tmp_path, monkeypatch):
    shutil.copy(TOKENS, tmp_path / "mooncake_synthetic_300.jsonl")  # shadows the shipped one
    monkeypatch.setenv(study.TRACES_ENV, str(tmp_path))
    assert study.trace_dirs()[0] == tmp_path
    assert study.load_trace("mooncake_synthetic_300").format == "tokens"


def test_unknown_trace_names_the_known_ones():
    with pytest.raises(FileNotFoundError, match=r"'nope'.*mooncake_synthetic_1000"):
        study.load_trace("nope")
    with pytest.raises(TypeError, match="source=3"):
        study.load_trace(3)


# ------------------------------------------------------------------------------------ sweep


def test_sweep_figures_equal_the_replay_commands(tmp_path, small, capsys):
    path = tmp_path / "replay.json"
    assert (
        main(
            [
                "replay",
                str(SYNTHETIC),
                "--quiet",
                "--limit",
                "60",
                "--capacities",
                "1e5,3e5",
                "--policy",
                "clean_ahead,write_back",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    from_cli = study.from_json(path)  # a --json file reads back as a one-report result
    assert from_cli.records(timing=False) == small.records(timing=False)
    assert len(small.records()) == 4 and "write_back/lru" in printed
    for r in small.records():  # the figures the command printed, as its table formats them
        assert f"{r['hit_ratio']:.4g}" in printed and f"{r['vs_lru_total']:.4g}" in printed


def test_host_ratios_give_one_report_each():
    trace = study.load_trace(TOKENS)
    res = study.sweep(
        trace,
        device_pages=np.array([2, 4]),
        host_ratios=np.array([0, 2]),
        page_size=4,
        policies="write_through",
        progress=False,
    )  # numpy too
    assert [r["host_ratio"] for r in res.reports] == [0.0, 2.0]
    recs = res.records()
    assert [(r["host_ratio"], r["device_pages"], r["host_pages"]) for r in recs] == [
        (0.0, 2, 0),
        (0.0, 4, 0),
        (2.0, 2, 4),
        (2.0, 4, 8),
    ]
    # LRU(L1) does not depend on L2; with no L2 the two-tier LRU is LRU(L1)
    assert recs[0]["lru_l1_hit_ratio"] == recs[2]["lru_l1_hit_ratio"]
    assert recs[0]["lru_total_hit_ratio"] == recs[0]["lru_l1_hit_ratio"]
    assert all(r["device_tokens"] == 4 * r["device_pages"] for r in recs)


def test_progress_factory_gets_one_bar_per_replay():
    made = []

    class Bar:
        def __init__(self, total, desc):
            self.total, self.desc, self.n, self.closed = total, desc, 0, False
            made.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    study.sweep(TOKENS, device_pages=[2, 4], page_size=4, progress=Bar, host_ratios=2)
    assert [(b.total, b.n, b.closed) for b in made] == [(3, 3, True)] * 2
    assert made[0].desc.startswith("[1/2] clean_ahead/lru L1 2")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(capacities=[100]), ValueError, "capacities 100 must be at least one page"),
        (dict(capacities=[1e5], device_pages=[10]), ValueError, "not both"),
        (dict(capacities=["1e5"]), TypeError, "capacities '1e5' must be a number"),
        (dict(device_pages=[0]), ValueError, "device_pages=0 must be >= 1"),
        (dict(policies=["write_sideways"]), ValueError, "write_policy='write_sideways'"),
        (dict(evictions=[]), ValueError, "evictions: none given"),
        (dict(host_ratios=[-1]), ValueError, "host_ratio -1"),
        (dict(host_ratios=[]), ValueError, "host_ratios"),
        (dict(spec=3), TypeError, "spec=3"),
        (
            dict(spec=KVSpec(1, 1, 1, "float32", page_size=64), page_size=32),
            ValueError,
            "page_size=32 differs from spec.page_size=64",
        ),
        (dict(spec="layers=0"), ValueError, "num_layers=0"),
    ],
)
def test_bad_settings_are_refused_before_replaying(kwargs, error, match, monkeypatch):
    def no_replay(*a, **k):
        raise AssertionError("replayed")

    monkeypatch.setattr(study._replay, "run", no_replay)
    with pytest.raises(error, match=match):
        study.sweep(SYNTHETIC, **kwargs)


# ------------------------------------------------------------------------------------ result


def test_json_round_trip(small, tmp_path):
    text = small.to_json()
    assert json.loads(text)["format"] == study.FORMAT
    back = study.SweepResult.from_json(text)
    assert back == small and back.records() == small.records()
    path = tmp_path / "sweep.json"
    small.to_json(path)
    assert study.from_json(path) == small
    with pytest.raises(ValueError, match="not a"):
        study.from_json('{"something": "else"}')


def test_table_is_a_dataframe_with_pandas(small):
    pd = pytest.importorskip("pandas", reason='pandas: pip install -e ".[notebook]"')
    df = small.table()
    assert isinstance(df, pd.DataFrame) and len(df) == 4
    assert list(df.columns[:3]) == ["trace", "host_ratio", "config"]
    assert df.equals(study.from_json(small.to_json()).table())
    best = df.sort_values("bytes_moved").iloc[0]
    assert best["bytes_moved"] == min(r["bytes_moved"] for r in small.records())


def test_table_without_pandas_is_the_records(small, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if not installed
    table = small.table()
    assert table == small.records() and isinstance(table, list)
    assert table[0]["config"] == "clean_ahead/lru" and table[0]["device_tokens"] == 195 * 512


def test_plot_draws_on_the_given_axis(small):
    pytest.importorskip("matplotlib", reason='matplotlib: pip install -e ".[plot]"')
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2)
    try:
        assert small.plot(a) is a
        labels = [line.get_label() for line in a.get_lines()]
        assert labels == ["clean_ahead/lru", "write_back/lru", "LRU(L1)", "LRU(L1+L2)", "infinite"]
        hits = sorted(r["hit_ratio"] for r in small.records() if r["config"] == "write_back/lru")
        assert sorted(a.get_lines()[1].get_ydata()) == hits
        assert small.plot(b, y="bytes_moved") is b and len(b.get_lines()) == 2
        assert b.get_ylabel() == "bytes moved (MiB)"
        with pytest.raises(ValueError, match="y='config'"):
            small.plot(b, y="config")
        new = small.plot()
        assert new.figure is not fig
        plt.close(new.figure)
    finally:
        plt.close(fig)


def test_plot_without_matplotlib_names_the_extra(small, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[notebook\]"'):
        small.plot()


def test_study_does_not_load_the_engine():
    """The notebook API sits on the replay layer: the command line imports it, never the
    reverse, and neither the engine nor the lowering checks come with it."""
    code = (
        "import sys, hicache_jax.study; print(sorted(m for m in sys.modules if m.startswith("
        "('hicache_jax.engine', 'hicache_jax.lowering', 'hicache_jax.cli'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip() == "[]"


def test_replay_command_takes_a_trace_name(capsys):
    assert (
        main(["replay", "tokens_small", "--quiet", "--page-size", "4", "--device-pages", "2"]) == 0
    )
    assert f"trace {TOKENS.resolve()}: tokens, 3 requests" in capsys.readouterr().out
