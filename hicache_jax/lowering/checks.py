"""The lowering checks: every device program lowered for TPU or CUDA on a machine without
either, and each lowered module held to what the cache relies on.

``jax.export.export(jit_fn, platforms=(p,))(*shapes)`` produces the StableHLO module a ``p``
device would compile, custom calls included, from abstract arguments only
(:mod:`hicache_jax.lowering.catalogue` lists the programs). A failure names the program and the
platform:

* ``lowers``: it lowers at all. A host callback (``jax.debug.callback``, ``pure_callback``,
  ``io_callback``) cannot be lowered for a platform this machine lacks (jax 0.10: "the platform
  for the specified backend cpu is different from the lowering platform"): reported as a host
  callback. Every listed program runs per request, so none may hold one.
* ``no host callback``: no callback custom call, no ``send`` / ``recv`` / ``outfeed`` /
  ``infeed`` in the module (a later jax that lowers callbacks across platforms is still caught).
* ``donated``: a program that updates a pool has the pool's argument aliased to an output
  (``tf.aliasing_output``, or ``jax.buffer_donor``): jax drops a donation it cannot honour
  with only a warning, and the pool would then be copied whole every call.
* ``raw bits``: the pool arguments are unsigned integer bits, no tensor of a pool's shape has a
  float element type, and no ``convert`` takes or makes a pool-shaped tensor (a float pool made
  a donated scatter O(pool) on XLA:CPU; a whole-pool convert is a copy of the pool).
* ``kernel``: a Pallas program contains its custom call (``tpu_custom_call`` on TPU,
  ``mosaic_gpu*`` or a Triton call on CUDA), not an interpreted fallback.
* ``bound`` (per operation, over the program set): the distinct programs of each bucketed
  operation stay within :attr:`ProgramSet.bounds`.

:func:`check` runs everything; :func:`format_table` and :func:`report_json` render its report
(the ``hicache-jax lower`` command, :mod:`hicache_jax.cli.lower`, prints them).
"""

from __future__ import annotations

import dataclasses
import re
import time
import warnings
from collections.abc import Sequence
from typing import Any, cast

import jax

from hicache_jax.lowering.catalogue import Program, ProgramSet

__all__ = [
    "LoweringCheckError",
    "Lowered",
    "Report",
    "check",
    "check_bounds",
    "check_program",
    "format_table",
    "lower",
    "report_json",
]

#: What jax 0.10 raises when a host callback is lowered for a platform this machine lacks.
_CALLBACK_ERROR = "different from the lowering platform"
_CALLBACK_OPS = re.compile(r"stablehlo\.(send|recv|outfeed|infeed)\b")
_CUSTOM_CALL = re.compile(r"custom_call @([\w.$-]+)|call_target_name = \"([\w.$-]+)\"")
_FLOAT = r"(?:bf16|f16|f32|f64|f8\w*|f4\w*)"
#: Custom-call targets a Pallas kernel lowers to, per platform.
_KERNEL_TARGETS = {
    "tpu": ("tpu_custom_call",),
    "cuda": ("mosaic_gpu", "__gpu$xla.gpu.triton", "triton_kernel_call"),
}


class LoweringCheckError(AssertionError):
    """A lowered program breaks a check; the message names the program and the platform."""


@dataclasses.dataclass(frozen=True)
class Lowered:
    """One program lowered for one platform.

    Attributes:
        program, platform: what was lowered.
        text: the StableHLO module (None when it did not lower).
        error: why it did not lower (None when it did).
        warnings: what jax warned while lowering (e.g. a donation it could not use).
        seconds: time the lowering took.
    """

    program: Program
    platform: str
    text: str | None
    error: str | None
    warnings: tuple[str, ...]
    seconds: float

    @property
    def custom_calls(self) -> list[str]:
        """Distinct custom-call targets in the module, sorted."""
        found = {a or b for a, b in _CUSTOM_CALL.findall(self.text or "")}
        return sorted(found)


def lower(program: Program, platform: str) -> Lowered:
    """Export ``program`` for ``platform`` (``jax.export``; nothing runs, nothing is allocated)."""
    t0 = time.perf_counter()
    text = error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # Program.fn is a jax.jit function (its doc); the catalogue's tables type it loosely.
            fn = cast(jax.stages.Wrapped, program.fn)
            exported = jax.export.export(fn, platforms=(platform,))(*program.args, **program.kwargs)
            text = exported.mlir_module()
        except Exception as e:  # reported as the program's verdict, never raised
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            error = (
                f"host callback (or another op bound to this machine's backend: it "
                f"lowers only with its platform's device): {msg}"
                if _CALLBACK_ERROR in str(e)
                else msg
            )
    notes = tuple(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))
    return Lowered(program, platform, text, error, notes, time.perf_counter() - t0)


def _main_args(text: str) -> list[str]:
    """The text of each argument of ``@main``'s signature (type and attributes), in order."""
    sig = next((line for line in text.splitlines() if "func.func public @main(" in line), "")
    sig = sig.split("@main(", 1)[-1].split(") -> ", 1)[0]
    return [a.strip() for a in re.split(r"(?=%arg\d+: )", sig) if a.strip()]


def _not_aliased(text: str, args: list[str]) -> str | None:
    """Why argument 0 is not aliased to an output of its own type (None: it is). A donation
    jax cannot match to an output is lowered as ``jax.buffer_donor`` at most, and XLA then
    has nothing of the pool's type to put in the buffer: the pool is copied."""
    first = args[0] if args else ""
    m = re.search(r"tf\.aliasing_output = (\d+)", first)
    if m is None:
        return (
            "argument 0 is only a buffer donor, aliased to no output"
            if "jax.buffer_donor" in first
            else "argument 0 is aliased to no output"
        )
    sig = next((line for line in text.splitlines() if "func.func public @main(" in line), "")
    results = re.findall(r"tensor<[^>]*>", sig.split(") -> ", 1)[-1])
    want = re.match(r"%arg0: (tensor<[^>]*>)", first)
    k = int(m.group(1))
    if want is None or k >= len(results) or results[k] != want.group(1):
        return f"argument 0 is aliased to output {k} of another type"
    return None


def _dims(shape: tuple) -> str:
    return "x".join(str(int(d)) for d in shape)


def check_program(low: Lowered) -> list[str]:
    """Every failed check of one lowered program, each ``"<name> [<platform>]: <why>"``
    (empty: it passes)."""
    p, where = low.program, f"{low.program.name} [{low.platform}]"
    if low.text is None:
        return [f"{where}: does not lower: {low.error}"]
    text, bad = low.text, []
    calls = low.custom_calls
    callbacks = [c for c in calls if "callback" in c.lower()]
    op = _CALLBACK_OPS.search(text)
    if callbacks or op:
        found = ", ".join(callbacks) or (op.group(0) if op else "")
        bad.append(f"{where}: host callback in a per-request program ({found})")
    args = _main_args(text)
    if p.donated:
        why = _not_aliased(text, args)
        if why:
            warned = next((w for w in low.warnings if "donat" in w), "")
            bad.append(f"{where}: pool not donated ({why}{'; ' + warned if warned else ''})")
    bad += _raw_bits(where, p, text, args)
    if p.kernel:
        want = _KERNEL_TARGETS.get(low.platform, ())
        if not any(c.startswith(w) for c in calls for w in want):
            bad.append(
                f"{where}: Pallas kernel missing: no {' / '.join(want) or 'kernel'} "
                f"custom call (found {calls or 'none'}): a fallback was lowered"
            )
    return bad


def _raw_bits(where: str, p: Program, text: str, args: list[str]) -> list[str]:
    bad = []
    for shape in p.pool_shapes:
        dims = _dims(shape)
        floats = sorted(set(re.findall(rf"tensor<{dims}x({_FLOAT})>", text)))
        if floats:
            bad.append(
                f"{where}: pool stored as {'/'.join(floats)} (a tensor<{dims}x"
                f"{floats[0]}>), not raw bits"
            )
        for line in text.splitlines():
            if "stablehlo.convert" in line and f"tensor<{dims}x" in line:
                bad.append(f"{where}: convert of the whole pool shape {dims}: {line.strip()[:160]}")
                break
    if p.donated and args:
        m = re.match(r"%arg0: tensor<[\dx]*x(\w+)>", args[0])
        if m and not re.fullmatch(r"ui\d+", m.group(1)):
            bad.append(f"{where}: pool argument is {m.group(1)}, not unsigned raw bits")
    return bad


def check_bounds(pset: ProgramSet) -> list[str]:
    """Operations with more distinct programs than their bound: ``"<op> [<platform>]: ..."``."""
    sigs: dict[str, set] = {}
    for p in pset.programs:
        key = (
            p.fn,
            jax.tree.map(lambda a: (getattr(a, "shape", a), str(getattr(a, "dtype", ""))), p.args),
            tuple(sorted((k, repr(v)) for k, v in p.kwargs.items())),
        )
        sigs.setdefault(p.op, set()).add(repr(key))
    return [
        f"{op} [{pset.platform}]: {len(sigs.get(op, ()))} distinct programs, bound {b}"
        for op, b in pset.bounds.items()
        if len(sigs.get(op, ())) > b
    ]


@dataclasses.dataclass(frozen=True)
class Report:
    """The checks of a program set on one platform.

    Attributes:
        pset: the programs.
        lowered: one :class:`Lowered` per lowered program (``only`` may leave some out).
        failures: program name -> its failed checks; ``"bounds"`` -> :func:`check_bounds`'s.
    """

    pset: ProgramSet
    lowered: tuple[Lowered, ...]
    failures: dict[str, list[str]]

    @property
    def ok(self) -> bool:
        return not any(self.failures.values())

    def raise_for_failures(self) -> None:
        """Raise :class:`LoweringCheckError` listing every failure (nothing when all pass)."""
        msgs = [m for ms in self.failures.values() for m in ms]
        if msgs:
            raise LoweringCheckError("\n".join(msgs))


def check(pset: ProgramSet, *, only: Sequence[str] | None = None) -> Report:
    """Lower every program of ``pset`` (or those whose name starts with one of ``only``) for
    its platform, and check each one and the bounds."""
    chosen = [p for p in pset.programs if only is None or any(p.name.startswith(o) for o in only)]
    lowered = tuple(lower(p, pset.platform) for p in chosen)
    failures = {low.program.name: check_program(low) for low in lowered}
    failures["bounds"] = check_bounds(pset)
    return Report(pset, lowered, failures)


# ----------------------------------------------------------------------------------- output


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}" if n else "-"


def format_table(report: Report) -> str:
    """One row per program (name, pages, MiB moved, custom calls, lowering ms, verdict), then
    the operations' program counts beside their bounds."""
    ps = report.pset
    spec = ps.spec
    pool = spec.kv_shape(ps.device_pages + 1)
    head = (
        f"platform {ps.platform}; jax {jax.__version__}; spec {spec.num_layers}L "
        f"{spec.num_kv_heads}x{spec.head_dim} {spec.dtype} page {spec.page_size} "
        f"({spec.page_bytes / 2**20:.3g} MiB a page); L1 {ps.device_pages} pages "
        f"({spec.page_bytes * (ps.device_pages + 1) / 2**30:.2f} GiB, {_dims(pool)}); "
        f"L2 {ps.host_pages} pages ({spec.page_bytes * ps.host_pages / 2**30:.2f} GiB); "
        f"engine model: {_model_text(ps)}"
    )
    rows = [("program", "pages", "MiB", "custom calls", "ms", "verdict")]
    for low in report.lowered:
        fails = report.failures.get(low.program.name, [])
        verdict = "ok" if not fails else "FAIL: " + "; ".join(f.split(": ", 1)[1] for f in fails)
        rows.append(
            (
                low.program.name,
                str(low.program.pages or "-"),
                _mib(low.program.moved_bytes),
                ",".join(low.custom_calls) or "-",
                f"{low.seconds * 1e3:.0f}",
                verdict[:150],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [head, ""]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    lines.append("")
    counts: dict[str, int] = {}
    for p in ps.programs:
        counts[p.op] = counts.get(p.op, 0) + 1
    lines.append(
        "programs per operation (bound: the most it may compile): "
        + ", ".join(
            f"{op} {n}" + (f"/{ps.bounds[op]}" if op in ps.bounds else "")
            for op, n in counts.items()
        )
    )
    lines += [f"note: {n}" for n in ps.notes]
    bad = [m for ms in report.failures.values() for m in ms]
    lines.append(
        f"{len(report.lowered)} programs lowered for {ps.platform}: "
        + ("all checks pass" if not bad else f"{len(bad)} failures")
    )
    return "\n".join(lines)


def _model_text(ps: ProgramSet) -> str:
    m = ps.model
    if m is None:
        return "none"
    return (
        f"{m.num_layers}L d{m.d_model} {m.num_heads}/{m.num_kv_heads} heads ffn {m.ffn_dim} "
        f"vocab {m.vocab_size} {m.dtype} (weights as shapes)"
    )


def report_json(report: Report) -> dict[str, Any]:
    """The report as plain data: environment, sizes, one entry per program, the failures."""
    ps = report.pset
    return {
        "benchmark": "hicache-jax lower",
        "platform": ps.platform,
        "jax": jax.__version__,
        "spec": ps.spec.as_json(),
        "device_pages": ps.device_pages,
        "host_pages": ps.host_pages,
        "model": None if ps.model is None else dataclasses.asdict(ps.model),
        "bounds": ps.bounds,
        "notes": list(ps.notes),
        "programs": [
            {
                "name": low.program.name,
                "op": low.program.op,
                "pages": low.program.pages,
                "moved_bytes": low.program.moved_bytes,
                "custom_calls": low.custom_calls,
                "lower_ms": low.seconds * 1e3,
                "error": low.error,
                "failures": report.failures[low.program.name],
            }
            for low in report.lowered
        ],
        "bound_failures": report.failures["bounds"],
        "ok": report.ok,
    }
