"""Trace replay: both input formats, bad input, the block-LRU reference by hand, determinism,
HiCache L1-only (eviction=lru) against the block-LRU of L1's size, the CLI end to end.

Hit figures are pinned only where no write policy is involved (L1 only, or the references):
the write policies' semantics may change, the replay must not care.
"""

import ast
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hicache_jax import replay as R
from hicache_jax.cli.main import main
from hicache_jax.spec import HiCacheConfig, KVSpec

DATA = pathlib.Path(__file__).parent / "data"
SYNTHETIC = DATA / "mooncake_synthetic_300.jsonl"
CONVERSATION = DATA / "mooncake_conversation_300.jsonl"
TOKENS = DATA / "tokens_small.jsonl"


def _untimed(report: dict) -> dict:
    """A report without the figures that measure wall time."""
    out = json.loads(json.dumps(report))
    for r in out["results"]:
        for k in R.TIMING_FIELDS:
            r.pop(k)
    return out


# --------------------------------------------------------------------------------- formats


def test_mooncake_records_become_blocks_of_unique_tokens():
    trace = R.load_trace(SYNTHETIC)
    assert trace.format == "mooncake" and len(trace.requests) == 300
    assert trace.default_page_size() == 512
    first = json.loads(SYNTHETIC.read_text().splitlines()[0])
    req = trace.requests[0]
    toks = req.tokens()
    assert req.line == 1 and toks.dtype == np.int64 and toks.shape == (first["input_length"],)
    for i, h in enumerate(first["hash_ids"]):  # block h is h * 512 + arange(512), in order
        block = toks[i * 512 : (i + 1) * 512]
        np.testing.assert_array_equal(block, h * 512 + np.arange(block.size))
    assert first["input_length"] % 512 and toks.size < len(first["hash_ids"]) * 512  # partial


def test_block_size_and_fresh_ids_for_missing_blocks(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7, 3]}\n'
        '{"input_length": 12, "hash_ids": [7]}\n'
        '{"input_length": 8, "hash_ids": []}\n'
    )
    trace = R.load_trace(path, block_size=4)
    a, b, c = (r.tokens() for r in trace.requests)
    np.testing.assert_array_equal(a, [28, 29, 30, 31, 12, 13, 14, 15, 32, 33])  # 7, 3, fresh 8
    np.testing.assert_array_equal(b[:4], a[:4])
    assert not set(b[4:]) & set(a) and not set(c) & (set(a) | set(b))  # fresh ids never shared
    assert R.load_trace(path, block_size=4, limit=2).num_tokens == 22


def test_token_jsonl_lists_and_records_auto_detected():
    trace = R.load_trace(TOKENS)
    assert trace.format == "tokens" and trace.default_page_size() == R.TOKEN_PAGE_SIZE
    assert [r.line for r in trace.requests] == [1, 2, 4]  # the blank line 3 is skipped
    np.testing.assert_array_equal(trace.requests[1].tokens(), [1, 2, 3, 4, 9, 9, 9, 9, 5])
    assert trace.num_tokens == 27


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"input_length": 4, "hash_ids": [0]', "malformed JSON"),
        ('{"input_length": -1, "hash_ids": []}', "input_length=-1 must be an int >= 0"),
        ('{"input_length": 4, "output_length": -2, "hash_ids": [0]}', "output_length=-2"),
        ('{"input_length": 4.0, "hash_ids": [0]}', "input_length=4.0"),
        (
            '{"input_length": 513, "hash_ids": [0, 1, 2]}',
            "3 hash_ids but input_length=513 has only 2",
        ),
        ('{"input_length": 4, "hash_ids": [1.5]}', "hash_ids holds 1.5, not an int"),
        ('{"input_length": 4, "hash_ids": [true]}', "hash_ids holds True"),
        ('{"input_length": 4, "hash_ids": [-3]}', r"hash_ids must hold ints in \[0, 2\*\*63\)"),
        ('{"input_length": 4, "hash_ids": "0"}', "hash_ids must be a list of ints"),
        ('{"input_length": 4, "hash_ids": [0], "timestamp": "now"}', "timestamp='now'"),
        ('[1, 2, "3"]', "tokens holds '3'"),
        ('{"prompt": "hello"}', "expected a Mooncake record"),
        ("[1, 2, 3]", "a tokens record in a mooncake trace"),
    ],
)
def test_bad_input_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 4, "hash_ids": [0]}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl, line 3: .*{message}"):
        R.load_trace(path)


def test_empty_trace_and_bad_arguments(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        R.load_trace(path)
    with pytest.raises(ValueError, match="block_size=0"):
        R.load_trace(TOKENS, block_size=0)
    with pytest.raises(ValueError, match="limit=0"):
        R.load_trace(TOKENS, limit=0)


def _spec(text: str | None, page_size: int) -> KVSpec:
    """``hicache-jax replay --spec TEXT --page-size N``'s spec."""
    return KVSpec.parse(text, R.TINY_SPEC, page_size=page_size)


def test_spec_option():
    spec = _spec("layers=32,kv_heads=8,head_dim=128,dtype=bfloat16", 16)
    assert spec.page_bytes == 32 * 2 * 16 * 8 * 128 * 2
    assert _spec(None, 512).page_bytes == 2 * 512 * 4  # tiny default: 8 bytes a token
    with pytest.raises(ValueError, match="key=value"):
        _spec("heads=8", 16)
    with pytest.raises(ValueError, match="'x' is not an int"):
        _spec("layers=x", 16)
    with pytest.raises(
        ValueError,
        match=r"'page_size=8'.* one of layers, kv_heads, head_dim, "
        r"dtype, mla$",
    ):
        _spec("page_size=8", 16)  # replay's page size is --page-size


# ------------------------------------------------------------------------------ references


def test_page_keys_name_pages_by_their_prefix():
    keys = R.PageKeys(2)
    a = keys(np.array([1, 2, 3, 4, 5]))  # the partial page 5 is no page
    b = keys(np.array([1, 2, 3, 4, 6, 7]))
    c = keys(np.array([3, 4, 1, 2]))  # page (3, 4) again, under another prefix
    assert a == [0, 1] and b == [0, 1, 2] and c == [3, 4] and len(keys) == 5


def test_block_lru_by_hand():
    lru = R.BlockLRU(3)
    assert lru.serve([1, 2, 3]) == 0  # recency, oldest first: 3 2 1
    assert lru.serve([1, 2, 4]) == 2  # 3 4 2 1 -> 3 evicted (a leaf, not the root)
    assert len(lru) == 3
    assert lru.serve([1, 2, 3]) == 2  # 4 3 2 1 -> 4 evicted
    assert lru.serve([1, 2, 4]) == 2
    assert lru.serve([5]) == 0  # 4 2 1 5 -> 4 evicted: the deepest of 1-2-4 first
    assert lru.serve([1, 2]) == 2
    assert lru.serve([6, 7, 8, 9]) == 0  # longer than the cache: keeps its leading pages
    assert lru.serve([6, 7, 8]) == 3
    inf = R.BlockLRU(None)
    assert [inf.serve(k) for k in ([1, 2], [1, 3], [1, 2, 4], [5])] == [0, 1, 2, 0]


def test_reference_hits_by_hand():
    # page 4: r1 = A B, r2 = A C, r3 = A B (A=1234, B=A.5678, C=A.9999). Cap 1 keeps only A:
    # r2, r3 hit A. Cap 2: r2 hits A and evicts B, r3 hits A. Cap 3 and infinite: r3 hits A B.
    hits, distinct = R.reference_hits(R.load_trace(TOKENS), 4, [None, 1, 2, 3])
    assert hits == {None: 12, 1: 8, 2: 8, 3: 12} and distinct == 3


# ---------------------------------------------------------------------------------- replay


def test_replay_tiny_trace_l1_only_by_hand():
    trace = R.load_trace(TOKENS)
    report = R.run(trace, _spec(None, 4), device_pages=[2], host_ratio=0)
    (r,) = report["results"]
    assert (r["prompt_tokens"], r["hit_tokens"], r["device_hit_tokens"]) == (27, 8, 8)
    assert (r["host_hit_tokens"], r["bytes_to_host"], r["bytes_to_device"]) == (0, 0, 0)
    assert r["evicted_pages"] == 2 and r["host_pages"] == 0
    assert (r["lru_l1_hit_ratio"], r["infinite_hit_ratio"]) == (8 / 27, 12 / 27)
    assert r["vs_lru_l1"] == 1.0 and r["vs_infinite"] == pytest.approx(8 / 12)


@pytest.mark.parametrize("path", [SYNTHETIC, CONVERSATION], ids=["synthetic", "conversation"])
def test_l1_only_lru_equals_block_lru_of_l1(path):
    """An exact check of eviction order against an independent model: with no host pool and
    eviction=lru, HiCache must hit what the block-LRU of L1's pages hits (within 0.5%: the tree
    evicts whole nodes, the reference single pages). L1 holds the longest prompt, as a server's
    must: below that, a truncated prompt's one big node goes whole where the reference keeps
    its leading pages (6% fewer hits at half the longest prompt on the synthetic slice)."""
    trace = R.load_trace(path)
    ps = 128  # four pages a Mooncake block: partial blocks share pages too
    longest = max(r.num_tokens for r in trace.requests) // ps
    report = R.run(
        trace, _spec(None, ps), device_pages=[longest, 2 * longest, 4 * longest], host_ratio=0
    )
    for r in report["results"]:
        assert r["host_pages"] == 0 and r["host_hit_tokens"] == 0
        assert r["evicted_pages"] > 5 * r["device_pages"]  # eviction happens a lot
        lru = r["lru_l1_hit_ratio"] * r["prompt_tokens"]
        assert lru > 0 and abs(r["hit_tokens"] - lru) <= 0.005 * lru, r


def test_replays_are_deterministic():
    trace = R.load_trace(SYNTHETIC, limit=150)
    kw = dict(
        device_pages=[150],
        host_ratio=2,
        write_policies=["write_through", "write_back"],
        evictions=["lru", "lfu"],
    )
    spec = _spec(None, 128)
    a, b = R.run(trace, spec, **kw), R.run(trace, spec, **kw)
    assert any(r["bytes_to_host"] and r["evicted_pages"] for r in a["results"])  # work was done
    assert json.dumps(_untimed(a), sort_keys=True) == json.dumps(_untimed(b), sort_keys=True)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_any_write_policy_gives_consistent_figures(policy):
    trace = R.load_trace(CONVERSATION, limit=120)
    (r,) = R.run(trace, _spec(None, 512), device_pages=[60], host_ratio=3, write_policies=[policy])[
        "results"
    ]
    assert r["write_policy"] == policy and r["host_pages"] == 180
    assert r["hit_tokens"] == r["device_hit_tokens"] + r["host_hit_tokens"]
    assert r["hit_ratio"] <= r["infinite_hit_ratio"] and r["hit_tokens"] % 512 == 0
    assert r["bytes_to_device"] == r["host_hit_tokens"] // 512 * 4096  # every load-back is real
    assert r["vs_lru_total"] == pytest.approx(r["hit_ratio"] / r["lru_total_hit_ratio"])


def test_real_model_spec_moves_real_bytes():
    trace = R.load_trace(SYNTHETIC, limit=40)
    spec = _spec("layers=2,kv_heads=2,head_dim=8,dtype=bfloat16", 512)
    (r,) = R.run(trace, spec, device_pages=[120], host_ratio=2, write_policies=["write_back"])[
        "results"
    ]
    assert r["bytes_to_host"] > 0 and r["bytes_to_host"] % spec.page_bytes == 0


def test_replay_uses_the_public_api_only():
    """No ``obj._name`` in replay/driver.py but on its own ``self``."""
    tree = ast.parse(pathlib.Path(R.driver.__file__).read_text())
    bad = [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    assert bad == []


# ------------------------------------------------------------------------------------- CLI


def test_cli_sweep_with_json(tmp_path, capsys):
    path = tmp_path / "out" / "replay.json"
    rc = main(
        [
            "replay",
            str(SYNTHETIC),
            "--quiet",
            "--limit",
            "200",
            "--capacities",
            "1e5,3e5",
            "--policy",
            "write_through,write_back",
            "--json",
            str(path),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    for header in (
        "hit/inf",
        "hit/LRU(L1+L2)",
        "hit/LRU(L1)",
        "MB to host",
        "MB to device",
        "backups",
        "load-backs",
        "evicted pg",
        "evict-backup pg",
        "req/s",
        "L1 tokens",
        "LRU(L1)",
    ):
        assert header in out
    data = json.loads(path.read_text())
    assert data["env"]["backend"] == "cpu" and "load_average" in data["env"]
    assert data["trace"]["requests"] == 200 and data["spec"]["page_size"] == 512
    res = data["results"]
    assert [(r["device_pages"], r["write_policy"]) for r in res] == [
        (195, "write_through"),
        (195, "write_back"),
        (585, "write_through"),
        (585, "write_back"),
    ]
    assert all(r["host_pages"] == 4 * r["device_pages"] for r in res)
    assert res[0]["lru_l1_hit_ratio"] <= res[2]["lru_l1_hit_ratio"]


def test_cli_single_size_flags(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert (
        main(
            [
                "replay",
                str(TOKENS),
                "--quiet",
                "--page-size",
                "4",
                "--device-tokens",
                "8",
                "--host-ratio",
                "0",
                "--eviction",
                "lru,fifo",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    res = json.loads(path.read_text())["results"]
    assert [(r["eviction"], r["device_pages"], r["hit_tokens"]) for r in res] == [
        ("lru", 2, 8),
        ("fifo", 2, 8),
    ]
    assert "L1 tokens" not in capsys.readouterr().out  # one size: no sweep table


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "write_sideways"], "write_policy='write_sideways'"),
        (["--eviction", "random"], "eviction='random'"),
        (["--host-ratio", "-1"], "--host-ratio -1"),
        (["--capacities", "1e5,lots"], "expected numbers"),
        (["--device-tokens", "100"], "at least one page"),
        (["--spec", "layers=0"], "num_layers=0"),
    ],
)
def test_cli_bad_flags_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(SYNTHETIC), "--quiet", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_bad_trace_exits_2_without_traceback(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 4, "hash_ids": [0]}\n{"input_length": 4, "hash_ids": [x]}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_jax", "replay", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "bad.jsonl, line 2: malformed JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_plot_without_matplotlib_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(TOKENS), "--quiet", "--plot", "p.png"])
    assert exc.value.code == 2 and 'pip install -e ".[plot]"' in capsys.readouterr().err


def test_cli_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason='--plot needs matplotlib: pip install -e ".[plot]"')
    path = tmp_path / "sweep.png"
    assert (
        main(
            [
                "replay",
                str(TOKENS),
                "--quiet",
                "--page-size",
                "4",
                "--capacities",
                "4,8,16",
                "--plot",
                str(path),
            ]
        )
        == 0
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("eviction", ["lru", "fifo", "lfu", "mru", "filo", "slru"])
def test_clean_ahead_leaves_almost_nothing_to_copy_on_the_eviction_path(eviction):
    """On the synthetic slice, with prompts as long as a sixth of L1 (a fixed reserve of
    L1 / 16 left ~38% of evicted pages to copy on the allocation path under lru), the auto
    reserve follows the largest allocation: at most 1% of evicted pages are copied there."""
    trace = R.load_trace(SYNTHETIC)
    spec = _spec(None, 128)
    r = R.replay(
        trace,
        spec,
        HiCacheConfig(
            device_pages=2000,
            host_pages=8000,
            write_policy="clean_ahead",
            eviction=eviction,
            load_back_threshold=128,
        ),
    )
    assert r["evicted_pages"] > 10_000
    assert r["eviction_backup_pages"] <= 0.01 * r["evicted_pages"]


def test_cli_host_ratio_sweep_prints_ratio_to_two_tier_lru(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert (
        main(
            [
                "replay",
                str(SYNTHETIC),
                "--quiet",
                "--limit",
                "120",
                "--capacities",
                "1e5,3e5",
                "--host-ratio",
                "2,4",
                "--policy",
                "clean_ahead,write_back",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "== L2 = 2 x L1" in out and "== L2 = 4 x L1" in out and "/LRU(L1+L2)" in out
    reps = json.loads(path.read_text())["reports"]
    assert [rep["host_ratio"] for rep in reps] == [2.0, 4.0]
    for rep in reps:
        for r in rep["results"]:
            assert r["host_pages"] == round(rep["host_ratio"] * r["device_pages"])
            assert r["vs_lru_total"] == pytest.approx(r["hit_ratio"] / r["lru_total_hit_ratio"])


def test_cli_check_ideal_names_the_point_below(tmp_path, capsys):
    # every L2 hit declined (threshold above any prompt): the default is below LRU(L1+L2)
    args = [
        "replay",
        str(SYNTHETIC),
        "--quiet",
        "--limit",
        "120",
        "--capacities",
        "1e5",
        "--host-ratio",
        "2,4",
        "--load-back-threshold",
        "1000000",
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert main(args + ["--check-ideal", "1e-9"]) == 0  # any hit at all passes
    capsys.readouterr()
    data = json.loads((tmp_path / "r.json").read_text())
    vs = {rep["host_ratio"]: rep["results"][0]["vs_lru_total"] for rep in data["reports"]}
    floor = max(vs.values()) + 1e-6  # above every point: each one is named
    assert main(args + ["--check-ideal", str(min(floor, 1.0))]) == 1
    err = capsys.readouterr().err
    assert "check-ideal failed" in err
    for ratio in vs:
        if vs[ratio] < min(floor, 1.0):
            assert f"L1 99840 tokens, L2 = {ratio:g} x L1" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--host-ratio", "2,x"], "--host-ratio 'x'"),
        (["--host-ratio", "2,-1"], "--host-ratio -1"),
        (["--check-ideal", "1.5"], "--check-ideal 1.5"),
        (["--check-ideal", "0.9", "--policy", "write_back"], "add it to --policy"),
    ],
)
def test_cli_bad_sweep_flags_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(SYNTHETIC), "--quiet", "--limit", "10", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_diagnose_accounts_for_the_gap_to_the_two_tier_lru():
    """``diagnose``: pages the LRU of L1 + L2 hits that the cache misses, and the reverse, add
    up to the difference of their hits; the tier figures stay within the pools; the figures
    are deterministic and the replay's own figures unchanged."""
    trace = R.load_trace(SYNTHETIC, limit=150)
    spec = _spec(None, 128)
    kw = dict(device_pages=[60], host_ratio=2, write_policies=["clean_ahead", "write_back"])
    plain, a, b = (
        R.run(trace, spec, **kw),
        R.run(trace, spec, diagnose=True, **kw),
        R.run(trace, spec, diagnose=True, **kw),
    )
    assert json.dumps(_untimed(a), sort_keys=True) == json.dumps(_untimed(b), sort_keys=True)
    for p, r in zip(plain["results"], a["results"]):
        assert {
            k: v for k, v in r.items() if not k.startswith("diag_") and k not in R.TIMING_FIELDS
        } == {k: v for k, v in p.items() if k not in R.TIMING_FIELDS}
        ref = round(r["lru_total_hit_ratio"] * r["prompt_tokens"]) // 128
        assert (
            r["hit_tokens"] // 128 - ref
            == r["diag_gained_vs_lru_pages"] - r["diag_lost_vs_lru_pages"]
        )
        assert 0 <= r["diag_mean_l1_free_pages"] <= 60
        assert 0 <= r["diag_mean_l2_redundant_pages"] <= r["host_pages"]
    assert "lost vs LRU pg" in R.tables(a) and "lost vs LRU pg" not in R.tables(plain)
