"""Every device program lowered for TPU and CUDA on this CPU machine, and checked; wrong programs
built on purpose are rejected by name. (hicache_jax/lowering/checks.py, lowering_programs.py)"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from hicache_jax import StateArray, lowering
from hicache_jax.cli.main import main
from hicache_jax.engine import layers
from hicache_jax.engine import model as model_mod
from hicache_jax.lowering.catalogue import LLAMA3_8B, Program, engine_model
from hicache_jax.memory import device_pool, page_copy
from hicache_jax.spec import KVSpec

# The engine tests' KV (2 layers, 2 kv heads of 8) in bfloat16, pages of 16 tokens.
TINY = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=16)
PAGES = 4

OPS = {
    "device_pool.write[xla]",
    "device_pool.read[xla]",
    "device_pool.write[pallas]",
    "device_pool.read[pallas]",
    "pallas.scatter_layer_pages",
    "device_pool.take_first",
    "device_pool.pad",
    "host_pool.write",
    "host_pool.read",
    "transfer.backup",
    "transfer.load",
    "transfer.load_layer",
    "engine.prefill",
    "engine.decode",
    "engine.layer",
    "batched.step",
}


@pytest.fixture(scope="module")
def tiny_reports():
    ran = set(model_mod._RAN)
    tpu = lowering.programs(TINY, "tpu", device_pages=PAGES)
    cuda = lowering.programs(TINY, "cuda", device_pages=PAGES)
    # On CUDA the Pallas programs only at the pool's largest bucket: a Mosaic GPU kernel takes
    # ~0.3-2 s to lower here and its body is the same at every bucket (TPU lowers them all).
    big = f"{PAGES}p"
    names = [p.name for p in cuda.programs if not p.kernel or big in p.name]
    reports = {"tpu": lowering.check(tpu), "cuda": lowering.check(cuda, only=names)}
    assert ran == model_mod._RAN  # recording the batched steps marks nothing as compiled
    return reports


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_every_program_of_the_tiny_spec_lowers_and_passes(tiny_reports, platform):
    report = tiny_reports[platform]
    report.raise_for_failures()
    assert {p.op for p in report.pset.programs} == OPS
    assert {low.program.op for low in report.lowered} == OPS
    if platform == "tpu":
        assert len(report.lowered) == len(report.pset.programs)
    by_name = {low.program.name: low for low in report.lowered}
    kernel = "tpu_custom_call" if platform == "tpu" else "mosaic_gpu_v2"
    assert kernel in by_name[f"device_pool.write[pallas,{PAGES}p,uint16]"].custom_calls
    # The host pool's memory kind reaches the module: pinned_host buffers, device pools.
    backup = by_name["transfer.backup[plan 1024]"].text
    assert 'mhlo.memory_kind = "pinned_host"' in backup
    assert 'mhlo.memory_kind = "device"' in backup
    # Every bucketed operation has one program per power of two up to the pool, no more.
    assert report.pset.bounds["device_pool.write[xla]"] == 2 * 3  # 1, 2, 4 pages x 2 dtypes
    table = lowering.format_table(report)
    assert f"programs lowered for {platform}: all checks pass" in table


def test_the_programs_are_the_functions_the_code_dispatches(tiny_reports):
    fns = {p.op: p.fn for p in tiny_reports["tpu"].pset.programs}
    assert fns["engine.prefill"] is layers.STEP and fns["engine.decode"] is layers.STEP
    assert fns["engine.layer"] is layers.LAYER and fns["batched.step"] is layers.BATCH_STEP
    for op in ("transfer.backup", "transfer.load", "transfer.load_layer", "host_pool.write"):
        assert fns[op] is page_copy.copy_pages
    assert fns["host_pool.read"] is page_copy.gather_pages
    assert fns["device_pool.write[pallas]"] is fns["device_pool.write[xla]"]
    # The decode step runs unrolled over per-layer weights, a long prefill as a scan.
    steps = {
        p.name.split(",")[1]: p
        for p in tiny_reports["tpu"].pset.programs
        if p.op in ("engine.prefill", "engine.decode") and "," in p.name
    }
    params = {kind: p.args[2] for kind, p in steps.items()}  # STEP(cfg, pool, params, ...)
    assert "per_layer" in params["unrolled]"] and "per_layer" not in params["scan]"]


def test_llama3_8b_pool_of_gib_lowers_as_shapes_only():
    pset = lowering.programs(lowering.LLAMA3_8B_KV, "tpu", device_pages=2048, engine=False)
    pool = lowering.LLAMA3_8B_KV.kv_shape(2049)
    assert lowering.LLAMA3_8B_KV.page_bytes * 2049 > 4 * 2**30  # a pool of several GiB
    report = lowering.check(
        pset,
        only=[
            "device_pool.write[xla,2048p,uint16]",
            "device_pool.write[pallas,2048p,bfloat16]",
            "transfer.load[plan 2048]",
        ],
    )
    report.raise_for_failures()
    assert len(report.lowered) == 3
    assert "x".join(map(str, pool)) + "xui16> {tf.aliasing_output = 0" in report.lowered[0].text
    assert not report.failures["bounds"]


def test_llama3_8b_engine_model_is_its_kv_and_a_small_one_otherwise():
    assert engine_model(lowering.LLAMA3_8B_KV) == LLAMA3_8B
    small = engine_model(TINY)
    assert (small.num_layers, small.num_kv_heads, small.head_dim) == (2, 2, 8)
    assert engine_model(KVSpec(2, 2, 8, "float8_e4m3fn", page_size=16)) is None


# ----------------------------------------------------------------------------------------------
# Wrong programs built on purpose: each check must fail, naming the program and the platform.

POOL = jax.ShapeDtypeStruct(TINY.kv_shape(PAGES + 1), TINY.bits_dtype)
IDS = jax.ShapeDtypeStruct((4,), jnp.int32)
PAGES4 = jax.ShapeDtypeStruct(TINY.kv_shape(4), TINY.bits_dtype)


def _scatter(pool, ids, pages):
    return pool.at[:, :, ids].set(pages, mode="promise_in_bounds")


def _failures(name, fn, args, platform="tpu", **kw):
    prog = Program(name, "bad", fn, args, pool_shapes=(POOL.shape,), **kw)
    return lowering.check_program(lowering.lower(prog, platform))


def test_a_pool_not_donated_is_rejected_by_name():
    bad = _failures("bad.not_donated", jax.jit(_scatter), (POOL, IDS, PAGES4))
    assert len(bad) == 1 and bad[0].startswith("bad.not_donated [tpu]: pool not donated")
    ok = _failures("good.donated", jax.jit(_scatter, donate_argnums=0), (POOL, IDS, PAGES4))
    assert ok == []


def test_a_donation_jax_drops_is_rejected():
    # Donated, but the result has another dtype: nothing to alias, jax only warns.
    fn = jax.jit(lambda pool, ids: pool.astype(jnp.uint32), donate_argnums=0)
    bad = _failures("bad.dropped_donation", fn, (POOL, IDS), platform="cuda")
    assert any(m.startswith("bad.dropped_donation [cuda]: pool not donated") for m in bad)


def test_a_float_pool_is_rejected_by_name():
    fpool = jax.ShapeDtypeStruct(POOL.shape, jnp.bfloat16)
    fpages = jax.ShapeDtypeStruct(PAGES4.shape, jnp.bfloat16)
    bad = _failures("bad.float_pool", jax.jit(_scatter, donate_argnums=0), (fpool, IDS, fpages))
    assert any(m.startswith("bad.float_pool [tpu]: pool stored as bf16") for m in bad)
    assert any("pool argument is bf16" in m for m in bad)


def test_a_whole_pool_view_as_float_is_rejected():
    def viewed(pool, ids, pages):  # bits in and out, but the whole pool passes through bf16
        f = jax.lax.bitcast_convert_type(pool, jnp.bfloat16)
        f = f.at[:, :, ids].set(jax.lax.bitcast_convert_type(pages, jnp.bfloat16))
        return jax.lax.bitcast_convert_type(f, pool.dtype)

    bad = _failures("bad.float_view", jax.jit(viewed, donate_argnums=0), (POOL, IDS, PAGES4))
    assert any(m.startswith("bad.float_view [tpu]: pool stored as bf16") for m in bad)


def test_a_whole_pool_convert_is_rejected():
    fn = jax.jit(
        lambda pool, ids: (pool.astype(jnp.int32) + 1).astype(pool.dtype), donate_argnums=0
    )
    bad = _failures("bad.convert", fn, (POOL, IDS))
    assert any(m.startswith("bad.convert [tpu]: convert of the whole pool shape") for m in bad)


def test_a_host_callback_is_rejected_by_name():
    def called(pool, ids, pages):
        jax.debug.callback(lambda i: None, ids)
        return _scatter(pool, ids, pages)

    bad = _failures(
        "bad.callback", jax.jit(called, donate_argnums=0), (POOL, IDS, PAGES4), platform="cuda"
    )
    assert len(bad) == 1 and bad[0].startswith("bad.callback [cuda]: does not lower: host callback")


def test_a_pallas_fallback_is_rejected_by_name():
    # What a pool on CPU runs: the generic kernels in Pallas' interpreter, no custom call.
    scatter, _ = device_pool._pallas_copy_fns(pk.Impl.INTERPRET, None)
    bad = _failures(
        "bad.interpreted",
        device_pool.PROGRAMS["write"],
        (POOL, IDS, PAGES4),
        kwargs=dict(scatter=scatter, sharding=None),
        kernel=True,
    )
    assert len(bad) == 1 and bad[0].startswith("bad.interpreted [tpu]: Pallas kernel missing")
    tpu, _ = device_pool.platform_copy_fns("pallas", "tpu")
    assert (
        _failures(
            "good.kernel",
            device_pool.PROGRAMS["write"],
            (POOL, IDS, PAGES4),
            kwargs=dict(scatter=tpu, sharding=None),
            kernel=True,
        )
        == []
    )


def test_an_unbucketed_operation_is_rejected_by_its_bound():
    pset = lowering.programs(TINY, "tpu", device_pages=PAGES, engine=False)
    assert lowering.check_bounds(pset) == []
    write = next(p for p in pset.programs if p.op == "device_pool.write[xla]")
    # One program per page count instead of per bucket: 3 pages on top of the buckets.
    extra = [
        dataclasses.replace(
            write,
            name=f"write[{n}p]",
            args=(
                POOL,
                jax.ShapeDtypeStruct((n,), jnp.int32),
                jax.ShapeDtypeStruct(TINY.kv_shape(n), TINY.bits_dtype),
            ),
        )
        for n in (3,)
    ]
    bad = lowering.check_bounds(dataclasses.replace(pset, programs=pset.programs + tuple(extra)))
    assert bad == ["device_pool.write[xla] [tpu]: 7 distinct programs, bound 6"]


def test_report_raises_listing_the_failed_program():
    pset = lowering.programs(TINY, "tpu", device_pages=PAGES, engine=False)
    wrong = Program(
        "bad.not_donated", "bad", jax.jit(_scatter), (POOL, IDS, PAGES4), pool_shapes=(POOL.shape,)
    )
    report = lowering.check(dataclasses.replace(pset, programs=(wrong,)))
    assert not report.ok
    with pytest.raises(lowering.LoweringCheckError, match=r"bad\.not_donated \[tpu\]"):
        report.raise_for_failures()
    assert "FAIL: pool not donated" in lowering.format_table(report)


# ----------------------------------------------------------------------------------------------
# Arguments and the command.


def test_bad_arguments_raise_naming_them():
    with pytest.raises(ValueError, match="platform"):
        lowering.programs(TINY, "rocm", device_pages=8)
    with pytest.raises(ValueError, match="device_pages"):
        lowering.programs(TINY, "tpu", device_pages=0)
    with pytest.raises(TypeError, match="spec"):
        lowering.programs("llama", "tpu", device_pages=8)
    with pytest.raises(ValueError, match="auto"):
        device_pool.platform_copy_fns("auto", "tpu")
    with pytest.raises(ValueError, match="cpu"):
        device_pool.platform_copy_fns("pallas", "cpu")


def test_lower_command_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "lower.json"
    rc = main(
        [
            "lower",
            "--platform",
            "cuda",
            "--spec",
            "layers=2,kv_heads=2,head_dim=8,dtype=bfloat16,page_size=16",
            "--device-pages",
            "8",
            "--no-engine",
            "--only",
            "device_pool.write[xla",
            "--json",
            str(path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "device_pool.write[xla,8p,bfloat16]" in out and "all checks pass" in out
    data = json.loads(path.read_text())
    assert data["platform"] == "cuda" and data["ok"] and len(data["programs"]) == 8
    assert data["jax"] == jax.__version__
    with pytest.raises(SystemExit) as e:
        main(["lower", "--platform", "tpu", "--spec", "layers=none"])
    assert e.value.code == 2
    np.testing.assert_equal(data["spec"]["num_layers"], 2)


def test_the_cpu_programs_pass_too():
    # This machine's own: the XLA page loop, both pools in device memory (merged minor views).
    pset = lowering.programs(TINY, "cpu", device_pages=4, engine=False)
    assert not any(p.kernel for p in pset.programs)
    report = lowering.check(pset)
    report.raise_for_failures()
    assert any("interpreted" in n for n in pset.notes)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_window_groups_pools_and_copies_lower(platform):
    """A spec with a window group lists that group's pool programs and transfer copies at
    its own page shape (named ``window0.*``), and they lower and pass like the full group's."""
    spec = KVSpec.from_pattern(
        "3:1", num_layers=4, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=16, window=32
    )
    pset = lowering.programs(spec, platform, device_pages=PAGES, engine=False)
    ops = {p.op for p in pset.programs}
    assert {
        "window0.transfer.backup",
        "window0.transfer.load",
        "window0.device_pool.write[xla]",
        "transfer.fused_backup",
        "transfer.fused_load",
    } <= ops
    window = [p for p in pset.programs if p.name.startswith("window0.")]
    backup = next(p for p in window if p.op == "window0.transfer.backup")
    assert backup.args[0].shape[0] == 3  # the group's three layers, layer-first host buffer
    report = lowering.check(
        pset, only=["window0.transfer", "window0.device_pool.write", "transfer.fused"]
    )
    report.raise_for_failures()
    assert len(report.lowered) > 0
    # the patterned engine's steps, over the full pool and the window pool in one program
    pset = lowering.programs(spec, platform, device_pages=PAGES, engine=True)
    assert pset.model is not None and pset.model.layer_pattern == "3:1"
    report = lowering.check(pset, only=["engine.decode", "batched.step[3"])
    report.raise_for_failures()
    assert {low.program.op for low in report.lowered} == {"engine.decode", "batched.step"}


def test_lower_command_takes_a_layer_pattern(capsys):
    common = ["lower", "--platform", "tpu", "--device-pages", "4", "--no-engine"]
    spec = ["--spec", "layers=4,kv_heads=2,head_dim=8,page_size=16"]
    pattern = ["--layer-pattern", "3:1", "--window", "32", "--only", "window0.transfer"]
    assert main([*common, *spec, *pattern]) == 0
    assert "window0.transfer.backup" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([*common, "--window", "32"])
    assert exc.value.code == 2
    assert "--window / --chunk / --state need --layer-pattern" in capsys.readouterr().err


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("heads", [False, True], ids=["whole", "heads"])
def test_state_group_slot_programs_lower(platform, heads):
    """A recurrent (STATE) group's slot pools and copies are listed as ``state0.*`` at the
    slot's shape (one row of ``slot_words`` a layer; split over heads: ``state_heads`` heads
    of two halves of ``head_words``) and lower like the pages'."""
    axis = 0 if heads else None
    spec = KVSpec.from_pattern(
        "R3:F1",
        num_layers=4,
        num_kv_heads=2,
        head_dim=8,
        dtype="bfloat16",
        page_size=16,
        state=[StateArray("conv", (3, 16)), StateArray("ssm", (2, 8, 8), head_axis=axis)],
    )
    pset = lowering.programs(spec, platform, device_pages=PAGES, engine=False)
    state = [p for p in pset.programs if p.name.startswith("state0.")]
    backup = next(p for p in state if p.op == "state0.transfer.backup")
    group = spec.window_groups[0]
    assert backup.args[0].shape[0] == 3  # the group's three layers
    if heads:
        assert group.state_heads == 2
        assert backup.args[0].shape[-2:] == (2, group.head_words // 2)
    else:
        assert backup.args[0].shape[-1] == group.slot_words
    report = lowering.check(pset, only=["state0.transfer", "state0.device_pool.write"])
    report.raise_for_failures()
    assert len(report.lowered) > 0


def test_lower_command_takes_a_recurrent_pattern(capsys):
    common = ["lower", "--platform", "cuda", "--device-pages", "4", "--no-engine"]
    spec = ["--spec", "layers=4,kv_heads=2,head_dim=8,page_size=16"]
    pattern = ["--layer-pattern", "R3:F1", "--state", "conv:3x16,ssm:h2x8x8", "--only", "state0"]
    assert main([*common, *spec, *pattern]) == 0
    assert "state0.transfer.backup" in capsys.readouterr().out
    for bad in ("conv:3by16", "ssm:h2xh8x8"):
        with pytest.raises(SystemExit) as exc:
            main([*common, *spec, "--layer-pattern", "R3:F1", "--state", bad])
        assert exc.value.code == 2
        assert f"--state: {bad!r}" in capsys.readouterr().err


def test_the_hybrid_engine_steps_lower():
    """A spec of the reference hybrid (``R3:F1``, its own state arrays) lists the recurrent
    engine's prefill (chunked form) and decode (step form) steps, and both lower."""
    spec = KVSpec.from_pattern(
        "R3:F1",
        num_layers=4,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        page_size=16,
        state=[StateArray("conv", (3, 32)), StateArray("ssm", (4, 8, 8), head_axis=0)],
    )
    pset = lowering.programs(spec, "tpu", device_pages=PAGES, engine=True)
    assert pset.model is not None and pset.model.layer_pattern == "R3:F1"
    report = lowering.check(pset, only=["engine.recurrent"])
    report.raise_for_failures()
    assert {low.program.op for low in report.lowered} == {"engine.prefill", "engine.decode"}


@pytest.mark.parametrize(
    ("pattern", "platform"), [("R3:F1", "cuda"), ("R2:S1:F1", "tpu"), ("R2:S1:F1", "cuda")]
)
def test_the_hybrid_engines_steps_lower_with_local_layers_and_batched_rows(pattern, platform):
    """The reference hybrid's serial steps and the batched engine's recurrent rows (prefill
    chunks, decode rows) lower; a three-kind spec (``R2:S1:F1``: a sliding-window layer
    beside the recurrent and the full ones) is read back as that model, its steps taking
    the window pool beside the full one."""
    spec = KVSpec.from_pattern(
        pattern,
        num_layers=4,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        page_size=16,
        window=None if pattern == "R3:F1" else 32,
        state=[StateArray("conv", (3, 32)), StateArray("ssm", (4, 8, 8), head_axis=0)],
    )
    pset = lowering.programs(spec, platform, device_pages=PAGES, engine=True)
    assert pset.model is not None and pset.model.layer_pattern == pattern
    names = {p.name.split("[")[0] for p in pset.programs if ".recurrent" in p.name}
    assert names == {
        "engine.recurrent_prefill",
        "engine.recurrent_decode",
        "batched.recurrent_rows",
    }
    report = lowering.check(pset, only=["engine.recurrent", "batched.recurrent"])
    report.raise_for_failures()
    assert len(report.lowered) == 4
    if pattern != "R3:F1":  # the window pool rides with the full one (donated together)
        assert all(isinstance(low.program.args[3], tuple) for low in report.lowered)
