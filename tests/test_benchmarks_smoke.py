"""The benchmarks still run: the shared timing helper on a fake clock, and ``throughput.py``'s
whole path (build, convert, time, check, write results) at the smallest sizes."""
from __future__ import annotations

import json
import sys

from pathlib import Path

import pytest
import torch

from ttt2la.timing import Timing, time_side_by_side

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


class FakeClock:
    """A clock that moves only when a fake model runs, by that model's scripted durations."""

    def __init__(self):
        self.now = 100.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def model(self, name: str, durations):
        durations = iter(durations)

        def run(*_):
            self.calls.append(name)
            self.now += next(durations)
        return run


def test_median_and_spread_of_scripted_rounds():
    clock = FakeClock()
    # two warm-up calls each (0.5 s), then five timed rounds
    models = {"a": clock.model("a", [0.5, 0.5, 3, 1, 2, 5, 4]),
              "b": clock.model("b", [0.5, 0.5, 6, 2, 4, 10, 8])}
    t = time_side_by_side(models, (), units=12, rounds=5, max_seconds=1e9, warmup=2,
                          clock=clock)
    assert t["a"].seconds == (3, 1, 2, 5, 4) and t["b"].seconds == (6, 2, 4, 10, 8)
    assert t["a"].median == 3 and t["a"].rate == 4.0
    # quartiles of 1..5 (inclusive method) are 2 and 4: IQR 2 s of a 3 s median
    assert t["a"].iqr_pct == pytest.approx(200 / 3)
    assert t["a"].range_pct == pytest.approx(400 / 3)
    assert "IQR 67%, range 133%, n=5" == t["a"].spread()
    ratio = t["a"].speedup_over(t["b"])
    assert ratio.values == (2.0,) * 5 and ratio.iqr_pct == 0


def test_rounds_interleave_in_rotated_order_after_warmup():
    clock = FakeClock()
    models = {n: clock.model(n, [1.0] * 10) for n in "abc"}
    time_side_by_side(models, (), rounds=3, warmup=1, max_seconds=1e9, clock=clock)
    warmup, timed = clock.calls[:3], clock.calls[3:]
    assert warmup == list("abc")
    assert timed == list("abc") + list("bca") + list("cab")


@pytest.mark.parametrize("per_call, max_seconds, expected_rounds", [
    (4.0, 10.0, 3),      # the budget is spent after 3 rounds, the minimum anyway
    (1.0, 4.5, 5),       # 4 s after 4 rounds is inside the budget, 5 s after 5 is not
    (20.0, 1.0, 3),      # over budget from the first round: still the minimum of 3
    (0.1, 1e9, 7),       # the round limit stops it
])
def test_time_box_stops_between_rounds(per_call, max_seconds, expected_rounds):
    clock = FakeClock()
    t = time_side_by_side({"m": clock.model("m", [per_call] * 50)}, (), rounds=7, warmup=0,
                          max_seconds=max_seconds, clock=clock)
    assert t["m"].rounds == expected_rounds


def test_speedup_pairs_rounds_and_weighs_units():
    fast = Timing((1.0, 2.0, 1.0), units=10)
    slow = Timing((3.0, 8.0, 2.0), units=5)
    # per round: (10/1)/(5/3) = 6, (10/2)/(5/8) = 8, (10/1)/(5/2) = 4
    assert fast.speedup_over(slow).values == pytest.approx((6.0, 8.0, 4.0))
    assert fast.speedup_over(slow).median == pytest.approx(6.0)


def _benchmark_module(name: str):
    """Import ``benchmarks/<name>.py`` as the scripts import each other (their folder on the
    path), for the duration of a test."""
    import importlib

    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def _run_main(name: str, argv: list[str]) -> None:
    """``benchmarks/<name>.py``'s ``main(argv)``, the thread count it sets put back after."""
    threads = torch.get_num_threads()
    try:
        for module in _benchmark_module(name):
            module.main(argv)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def throughput():
    yield from _benchmark_module("throughput")


def test_throughput_script_end_to_end(throughput, tmp_path):
    out = tmp_path / "results"
    assert throughput.main(["--size", "smoke", "--muon", "off", "--levels", "2",
                            "--rounds", "2", "--threads", str(torch.get_num_threads()),
                            "--results", str(out)]) == 0
    lines = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert lines[0]["setup"]["size"] == "smoke"
    rows = {r["model"]: r for r in lines if r.get("kind") == "Row"}
    targets = [r for r in lines if r.get("kind") == "Target"]
    expected = {"original (level 0)", "level 2 converted", "variant 1 as written",
                "variant 2 as written", "variant 2 hand-written",
                "per-token (loop in helper) as written", "per-token (loop in helper) converted"}
    assert expected <= set(rows)
    for name in expected:
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["rounds"] == 2, name
    level2 = rows["level 2 converted"]
    assert level2["plan"].startswith("parallel on ")
    assert level2["error"] <= level2["bound"] == 1e-5
    hand = rows["variant 2 hand-written"]
    assert hand["error"] <= hand["bound"]
    assert {t["what"] for t in targets} >= {"level 2 ≥ 1.0× variant 2 hand-written",
                                           "level 2 useful FLOP/s ≥ 70% of the GEMM peak"}
    assert all(t["measured"] is not None and t["measured"] > 0 for t in targets)
    markdown = (out / "throughput.md").read_text()
    assert "partial" not in markdown
    assert markdown.count("| LaCT chunk 16, L=64, no Muon |") == 6 + 3
    assert all(r["peak"] > 0 for r in rows.values() if r["tokens_per_s"])
    assert "each case re-times them in its rounds: " in markdown and "no case yet" not in markdown
    alone = rows["level 2 converted: its matmuls alone"]
    assert alone["tokens_per_s"] > 0 and "matrix products of one call" in alone["plan"]
    ceilings = {t["what"]: t["ceiling"] for t in targets}
    assert "with its matmuls alone" in ceilings["level 2 useful FLOP/s ≥ 70% of the GEMM peak"]
    assert "at the GEMM peak" in ceilings["level 2 ≥ 1.0× variant 2 hand-written"]


def test_cases_with_many_chunks_time_the_published_operator_eagerly(throughput, tmp_path):
    """Dynamo would unroll a loop of this many chunks; those rows run eagerly and say so."""
    out = tmp_path / "results"
    chunks = throughput.COMPILED_CHUNKS + 1
    assert throughput.main(["--size", "smoke", "--muon", "off", "--levels", "2",
                            "--lact", f"2x{2 * chunks}", "--per-token-lengths", "--compile-whole",
                            "--rounds", "1", "--threads", str(torch.get_num_threads()),
                            "--results", str(out)]) == 0
    lines = list(map(json.loads, (out / "rows.jsonl").read_text().splitlines()))
    rows = {r["model"]: r for r in lines if r.get("kind") == "Row"}
    for name in ("original (level 0)", "variant 1 as written", "variant 2 as written"):
        assert rows[name]["plan"] == f"as written, run eagerly ({chunks} chunks, not compiled)"
        assert rows[name]["tokens_per_s"] > 0
    assert rows["level 2 converted"]["error"] <= rows["level 2 converted"]["bound"]
    # nor are they compiled whole: those rows say why, and no target compares with them
    for name in (throughput.COMPILED_ORIGINAL, throughput.COMPILED_LEVEL_2):
        assert rows[name]["tokens_per_s"] is None
        assert f"{chunks} chunks, over {throughput.COMPILED_CHUNKS}" in rows[name]["not_timed"]
    assert not [t for t in lines if t.get("kind") == "Target" and "compiled" in t["what"]]


def test_compiled_plan_rows_and_their_targets(throughput, tmp_path, monkeypatch):
    """``--compile-plan`` adds a conversion made with ``compile=True`` to a LaCT case and to the
    per-token case, each timed beside the eager conversion and held to the same targets
    (``compile=True`` meaning aot_eager here, which compiles in seconds, and the rows as written
    run eagerly)."""
    import ttt2la.compiled_plan
    monkeypatch.setattr(ttt2la.compiled_plan, "DEFAULT_BACKEND", "aot_eager")
    # the rows as written run eagerly: compiled by inductor they would only add its compile time
    # (most of a minute on 2 cores with a cold cache)
    monkeypatch.setattr(throughput, "COMPILED_CHUNKS", 0)
    out = tmp_path / "results"
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        assert throughput.main(["--size", "smoke", "--muon", "on", "--levels", "2",
                                "--compile-plan", "--rounds", "1",
                                "--threads", str(torch.get_num_threads()),
                                "--results", str(out)]) == 0
        torch._dynamo.reset()
    lines = list(map(json.loads, (out / "rows.jsonl").read_text().splitlines()))
    rows = {r["model"]: r for r in lines if r.get("kind") == "Row"}
    compiled = [name for name in rows if name.endswith("converted, compile=True")]
    assert throughput.COMPILED_PLAN in compiled and len(compiled) >= 2
    for name in compiled:
        assert rows[name]["tokens_per_s"] > 0
        assert "under torch.compile (aot_eager)" in rows[name]["plan"]
    targets = {t["what"]: t for t in lines if t.get("kind") == "Target"}
    for what in ("level 2 with compile=True ≥ 1.0× variant 2 as written",
                 "level 2 with compile=True ≥ 1.8× the original",
                 "level 2 with compile=True useful FLOP/s ≥ 70% of the GEMM peak"):
        assert targets[what]["measured"] is not None
    assert any("converted with compile=True ≥" in what for what in targets)


def test_compiled_whole_rows_compile_the_layers_timed_eagerly(throughput):
    """``--compile-whole`` compiles the very modules of the eager rows, and keeps each row's
    FLOPs and reference."""
    original, converted = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    candidates = {"original (level 0)": throughput.Candidate(original, "as written", 3.0),
                  "level 2 converted": throughput.Candidate(converted, "", 2.0, "variant 2")}
    rows = throughput.compiled_whole(candidates, throughput.COMPILED_CHUNKS)
    compiled = rows[throughput.COMPILED_ORIGINAL], rows[throughput.COMPILED_LEVEL_2]
    assert [c.model._orig_mod for c in compiled] == [original, converted]
    assert [(c.flops_per_token, c.reference) for c in compiled] == [(3.0, None), (2.0, "variant 2")]


def test_per_token_layers_alone_with_the_half_gemms_forced(throughput, tmp_path):
    """``--lact`` with no case times the per-token layers only; ``--half-gemms`` is named in the
    header and forces the path for the run only."""
    from ttt2la.runtime.newton_schulz import CPU_NATIVE_HALF, half_gemms_native
    out = tmp_path / "results"
    assert throughput.main(["--size", "smoke", "--lact", "--half-gemms", "fp32", "--rounds", "1",
                            "--threads", str(torch.get_num_threads()),
                            "--results", str(out)]) == 0
    rows = [r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())
            if r.get("kind") == "Row"]
    assert rows and all(r["model"].startswith("per-token") for r in rows)
    assert "half GEMMs on CPU: fp32 GEMMs of half operands (forced: --half-gemms fp32)" in \
        (out / "throughput.md").read_text()
    assert half_gemms_native(torch.bfloat16, torch.device("cpu")) == \
        CPU_NATIVE_HALF[torch.bfloat16]


@pytest.fixture
def ceiling():
    yield from _benchmark_module("ceiling")


def test_ceiling_records_every_matrix_product_and_only_those(ceiling):
    """Forward and backward products of a call, with their layouts and FLOPs; nothing else."""
    lin = torch.nn.Linear(6, 5, bias=True)
    x = torch.randn(3, 6, requires_grad=True)
    a, b = torch.randn(4, 2, 7), torch.randn(4, 7, 3)
    out = torch.empty(4, 3, 2).transpose(1, 2)

    def call():
        y = torch.relu(lin(x)).sum() + torch.baddbmm(out, a, b).sum()
        torch.bmm(a, b.expand(4, 7, 3), out=out)
        y.backward()

    products = ceiling.record_matmuls(call)
    ops = [p.op.overloadpacket for p in products]
    aten = torch.ops.aten
    assert ops.count(aten.addmm) == 1 and ops.count(aten.baddbmm) == 1
    assert ops.count(aten.bmm) == 1 and ops.count(aten.mm) == 2      # backward: dx and dW
    assert not set(ops) - ceiling.MATMULS
    bmm = next(p for p in products if p.op.overloadpacket is aten.bmm)
    assert bmm.kwargs["out"].stride == (6, 1, 2) and bmm.args[0].shape == (4, 2, 7)
    expected = 2 * (3 * 6 * 5) + 2 * (4 * 2 * 7 * 3) * 2 + 2 * (3 * 5 * 6) + 2 * (5 * 3 * 6)
    assert ceiling.matmul_flops(products) == expected


def test_ceiling_replay_runs_the_same_products_on_fresh_operands(ceiling):
    """Broadcast strides and ``out=`` views replay; the call's own tensors are not touched."""
    a, w = torch.randn(5, 8), torch.randn(8, 1).expand(8, 4)
    out = torch.zeros(4, 5).t()
    products = ceiling.record_matmuls(lambda: torch.mm(a, w, out=out))
    before = out.clone()
    replay = ceiling.Replay(products)
    replay(torch.randn(2))
    assert torch.equal(out, before)
    (args, kwargs), = (stand for _, stand in replay.calls)
    assert args[1].stride() == (1, 0) and kwargs["out"].stride() == (1, 5)
    assert not torch.equal(kwargs["out"], torch.zeros(5, 4))


def test_a_target_beyond_the_gemm_peak_says_so(throughput):
    """The ceilings of a speed-up target: replayed products and useful FLOPs at the peak."""
    setup = throughput.Setup(peak=1e9)
    tokens = 100
    timings = {"fast": Timing((0.5, 0.5, 0.5), tokens), "slow": Timing((2.0, 2.0, 2.0), tokens),
               f"fast: {throughput.ALONE}": Timing((0.25, 0.25, 0.25), tokens)}
    rows = [throughput.Row("c", "fast", "p", flops_per_token=2e6),
            throughput.Row("c", f"fast: {throughput.ALONE}", "p", flops_per_token=2e6)]
    far = throughput.Target("c", "fast ≥ 9× slow", "fast", 9.0, "slow")
    near = throughput.Target("c", "fast ≥ 3× slow", "fast", 3.0, "slow")
    throughput.evaluate([far, near], rows, timings, setup)
    # 2 s against 0.25 s replayed: 8×; 200 MFLOP at 1 GFLOP/s: 0.2 s, so at most 10×
    assert far.measured == pytest.approx(4.0) and near.measured == pytest.approx(4.0)
    assert far.ceiling == "≤ 8.00× with its matmuls alone; ≤ 10.00× with its useful FLOPs at " \
                          "the GEMM peak"
    assert not far.beyond_peak and far.met is False
    far.threshold = 11.0
    throughput.evaluate([far], rows, timings, setup)
    assert far.beyond_peak and throughput._verdict(far) == "**missed**: beyond the GEMM peak"
    assert throughput._verdict(near) == "met"
    near.measured = 2.9981
    assert throughput._fmt_measured(near) == "2.998" and throughput._verdict(near) == "**missed**"
    # a case measures against the peak timed in its own rounds, not the run's first one
    for row in rows:
        row.peak = 2e9
    throughput.evaluate([far], rows, timings, setup)
    assert far.ceiling.endswith("≤ 20.00× with its useful FLOPs at the GEMM peak")
    assert not far.beyond_peak


def test_keep_freed_memory_configures_glibc_or_says_why_not():
    """Run in a child process: the setting is process-wide and must not leak into the suite."""
    import platform
    import subprocess

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import allocator\n"
            "try:\n    print(allocator.keep_freed_memory())\n"
            "except OSError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    if platform.libc_ver()[0] == "glibc":
        assert out.startswith("glibc ") and "keeping freed memory" in out, out
    else:
        assert out.startswith("refused: "), out


def test_a_timed_training_step_does_three_times_the_forward_products(throughput, ceiling):
    """With ``--backward`` useful FLOPs are 3× the forward's: the input's gradient is computed
    too, as for a layer inside a network."""
    layer = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(6, 4, bias=False))
    x = torch.randn(5, 8)
    step = throughput._callables({"layer": layer}, backward=True)["layer"]
    with torch.no_grad():
        forward = ceiling.matmul_flops(ceiling.record_matmuls(layer, x))
    assert forward == 2 * 5 * (8 * 6 + 6 * 4)
    assert ceiling.matmul_flops(ceiling.record_matmuls(step, x)) == 3 * forward
    assert x.grad is None and not x.requires_grad


def test_gpu_benchmark_script_runs_in_the_interpreter(tmp_path):
    """``gpu_bench.py`` runs where a GPU is scarce: its smoke mode (Triton's interpreter, the tiniest
    shapes) must run the token-causal sections (a decay per head, per key channel) and tile tuning and
    write a row for each measurement, none of them failed, in the order of ``--sections`` (a short GPU
    slot measures what it needs most first)."""
    pytest.importorskip("triton", reason="triton is not installed")
    import os
    import subprocess

    out = tmp_path / "gpu.md"
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_bench.py"), "--device", "cpu",
                          "--size", "tiny", "--sections", "f,b,e", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| (")]
    assert not any("failed:" in r for r in rows), rows
    assert list(dict.fromkeys(r[3] for r in rows)) == ["f", "b", "e"], [r[:40] for r in rows]
    tuning = [r for r in rows if r.startswith("| (e)")]
    assert len(tuning) == 14 and all(r.split("|")[4].strip() != "-" for r in tuning)   # each timed
    assert sum("tuned tiles," in r or "tuned tiles |" in r for r in tuning) == 8
    assert all("the default tiles ran" in r for r in tuning if "tuned tiles" in r)
    assert sum("one per site" in r for r in tuning) == 2
    assert sum("Triton chunk op" in r for r in rows if r.startswith("| (b)")) == 2
    per_channel = [r for r in rows if r.startswith("| (f)") and ("torch runtime" in r or "Triton chunk op" in r)]
    assert len(per_channel) == 4 and all(r.split("|")[4].strip() != "-" for r in per_channel)


def test_delta_rule_memory_benchmark_compares_outputs_and_gradients():
    """``matrix_affine_memories.py``'s error columns on a small mini-batch delta rule: the
    converted layer's outputs and every parameter gradient against the layer as written, on
    both paths the cost rule can take."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import matrix_affine_memories as bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    import ttt2la

    torch.manual_seed(0)
    layer = bench.MiniBatchDelta(4, 2, 4)
    x = torch.randn(2, 37, 8)
    fast = ttt2la.convert(layer, level=0, example_inputs=(x[:1, :16],))
    forward = bench._forward_rows(layer, fast)
    training = {"as written": bench._TrainingStep(layer),
                "converted (cost rule)": bench._TrainingStep(fast)}
    for row in ("converted, scan forced", "converted, loop forced"):
        assert bench._forward_error(forward, row, x) <= 1e-5
    with bench.scanning(True):
        assert bench._gradient_error(training, "converted (cost rule)", x) <= 1e-5
    with bench.scanning(False):
        assert bench._gradient_error(training, "converted (cost rule)", x) <= 1e-5
    assert set(training["as written"].grads()) == {n for n, _ in layer.named_parameters()}


def test_gated_memory_benchmark_prints_every_row_with_its_plan_and_error(capsys):
    """``gated_memories.py``'s table on one small gated memory: the layer as written, the
    converted layer as shipped and its plan alone, and both forced paths, each converted row
    naming the plan that ran and its error against the layer as written."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gated_memories as bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    from ttt2la.zoo import GatedChunkMemory

    torch.manual_seed(0)
    case = ("small gated memory", GatedChunkMemory(8, 2, 4), torch.randn(2, 32, 8))
    bench.print_table([case], backward=False, rounds=1)
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| small")]
    assert [r.split("|")[2].strip() for r in rows] == [
        "as written", "converted (as shipped)", "converted, plan alone (cost rule)",
        "converted, scan forced", "converted, loop forced"]
    errors = [float(r.split("(error ")[1].split(")")[0]) for r in rows[1:]]
    assert all(e <= 1e-5 for e in errors), rows
    assert "sequential: W" in rows[4] and "sequential" not in rows[3]


def test_expansion_rule_times_both_loops_and_names_the_rules_choice(capsys, monkeypatch):
    """``gated_memories.py --expansions`` on two small shapes: every row times the layer as
    written and both loops, names the side the size rule picks, and both loops equal the layer
    as written."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gated_memories as bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    monkeypatch.setattr(bench, "EXPANSION_GRID", [(4, 1), (16, 2)])
    monkeypatch.setattr(bench, "LENGTH", 32)
    monkeypatch.setattr(bench.loop_expansions, "EXPANSION_MIN_ELEMENTS", 1024)
    bench.expansion_rule(rounds=1)
    rows = [r.split("|") for r in capsys.readouterr().out.splitlines() if r.startswith("| ")]
    rows = [r for r in rows if r[1].strip().isdigit()]
    assert [(r[1].strip(), r[3].strip(), r[8].strip()) for r in rows] == [
        ("4", "256", "batched"), ("16", "4,096", "moved")]
    for r in rows:
        assert all(float(e) <= 1e-5 for e in r[9].split(","))


@pytest.fixture
def lact_operator():
    yield from _benchmark_module("lact_operator")


def test_lact_operator_script_times_the_operator_beside_the_layers(lact_operator, capsys):
    assert lact_operator.main(["--chunk", "4", "--length", "16", "--rounds", "1"]) == 0
    table = capsys.readouterr().out
    for row in ("variant 2's operator", "converted operator (level 2)",
                "variant 2 as written (layer)", "level 2 converted (layer)"):
        assert f"| {row} |" in table, row
    # both converted rows name their error against variant 2, and it is within fp32's bound
    errors = [float(line.rsplit("|", 2)[1]) for line in table.splitlines()
              if line.startswith(("| converted operator", "| level 2 converted"))]
    assert len(errors) == 2 and all(e <= 1e-5 for e in errors), errors


def test_fused_styles_benchmark_prints_every_row_with_its_error(capsys):
    """``fused_styles.py`` on small layers: per case the layer as written, the hand-written
    loop, the converted layer as shipped and its plan alone, each with its error against the
    layer as written (within the fp32 bound where no Newton–Schulz runs)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fused_styles as bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    cases = list(bench.cases(True, dim=8, batch=2, length=128))
    bench.print_table(cases, rounds=1)
    rows = [r for r in capsys.readouterr().out.splitlines()
            if r.startswith("| ") and not r.startswith("| case")]
    assert [r.split("|")[2].strip() for r in rows[:4]] == [
        "as written", "hand-written (plain arithmetic)", "converted (as shipped)",
        "converted, plan alone"]
    assert len(cases) == 7 and len(rows) == 4 * len(cases)
    for r in rows:
        cells = [c.strip() for c in r.split("|")]
        if cells[2] != "as written" and "Newton" not in cells[1]:
            assert float(cells[6].rsplit("(", 1)[-1].rstrip(")")) <= 1e-5, r
    # a training step: as written and converted, the error over the parameter gradients
    bench.print_table(list(bench.cases(True, dim=8, batch=2, length=128))[:1], rounds=1,
                      backward=True)
    rows = [r for r in capsys.readouterr().out.splitlines()
            if r.startswith("| ") and not r.startswith("| case")]
    assert [r.split("|")[2].strip() for r in rows] == ["as written", "converted (as shipped)"]
    assert float(rows[1].split("|")[6].rsplit("(", 1)[-1].split(")")[0]) <= 1e-5, rows[1]


def test_fla_reference_value_decay_table_runs_generic_and_lifted(capsys):
    """``fla_reference.py --value-decay`` on small layers: as written, the generic plan and the
    lifted op, forward and training step, each converted row within the fp32 bound."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fla_reference as bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    bench.value_decay_table(16, 1, dim=8, heads=2, batch=1)
    rows = [r for r in capsys.readouterr().out.splitlines()
            if r.startswith("| ") and not r.startswith("| case")]
    assert len(rows) == 12
    for r in rows:
        cells = [c.strip() for c in r.split("|")]
        if cells[3] == "generic plan":
            assert "linear_attention" not in cells[7], r
        elif cells[3] == "lifted":
            assert "_linear_attention[torch]" in cells[7], r
        if cells[3] != "as written":
            assert float(cells[7].rsplit("(", 1)[-1].rstrip(")")) <= 1e-5, r


def test_fla_reference_benchmark_prints_every_row_with_its_error(capsys):
    """``fla_reference.py`` on small layers: every recurrence as written, by hand with matmuls,
    converted as shipped and its plan alone, each within the fp32 bound of the layer as
    written (the hand-written loops compute the same function)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fla_reference as bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    bench.print_table(list(bench.cases(True, dim=16, heads=2, batch=2, length=32)), rounds=1)
    rows = [r for r in capsys.readouterr().out.splitlines()
            if r.startswith("| ") and not r.startswith("| case")]
    assert len(rows) == 60
    for r in rows:
        cells = [c.strip() for c in r.split("|")]
        if cells[2] != "as written":
            assert float(cells[6].rsplit("(", 1)[-1].rstrip(")")) <= 1e-5, r
    plans = {r.split("|")[1].strip().split(",")[0]: r.split("|")[6] for r in rows
             if "plan alone" in r}
    assert "chunk_linear_attention" in plans["retention"]
    assert "delta_rule" in plans["gated_delta"]
    assert "chunk_linear_attention" in plans["per-token TTT read before write"]
    assert "chunk_linear_attention" in plans["ssd"]
    assert "chunk_linear_attention" in plans["vector_gate"]          # the strong decay's
    assert "chunk_linear_attention" in plans["value_gate"]
    assert "z as value columns" in plans["normalised"]
    assert "plus each token's own term" in plans["rwkv6"]
    assert "block_linear_attention" in plans["gla"] and "block_linear_attention" in plans["simple_gla"]
    assert "block_linear_attention" in plans["gla_value"]


def test_varying_lengths_benchmark_times_both_sides_at_fresh_lengths(capsys):
    """``varying_lengths.py`` with a few calls: every case prints its totals over distinct
    lengths and the cost of a first call at a new length against a later one."""
    _run_main("varying_lengths", ["--calls", "4"])
    out = capsys.readouterr().out
    assert out.count("4 calls at") == 2 and out.count("first call at a new length") == 2, out


def test_single_step_benchmark_times_plan_and_source_for_each_block(capsys):
    """``single_step.py`` at a tiny image: each block's forward and training step, the plan
    (race off) beside its source, with the ratio."""
    _run_main("single_step", ["--rounds", "2", "--dim", "8", "--side", "4"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ViTTT")]
    assert len(rows) == 4 and all(row.endswith("× |") for row in rows), rows


def test_few_chunks_benchmark_times_plan_and_source_and_splits_the_forward(capsys):
    """``few_chunks.py`` at a tiny size: a layer's forward and training step, the plan (race
    off) beside its source, with the ratio, and the forward split around the runtime op."""
    _run_main("few_chunks", ["--rounds", "2", "--lengths", "128", "--dim", "16",
                             "--layers", "SplitZipLayer"])
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| SplitZipLayer")]
    assert len(rows) == 2 and all("× |" in row for row in rows), rows
    assert "op " in rows[0] and "call around the plan" in rows[0], rows[0]


def test_fp32_accuracy_benchmark_measures_both_sides_against_float64(capsys):
    gen = _benchmark_module("fp32_accuracy")
    fp32_accuracy = next(gen)
    try:
        status = fp32_accuracy.main(["--seeds", "1", "--lengths", "5"])
    finally:
        gen.close()
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:] if line.startswith("   0   5 ")]
    assert {r[2] for r in rows} >= {"output", "lr_proj.weight", "w1"}
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)   # fp32 differs from float64
    assert status == (0 if "within 2x the original's error + 1e-6: " f"{len(rows)} of {len(rows)}"
                      in out else 1)
    assert fp32_accuracy.within_criterion(1e-5, 2.1e-5) and \
        not fp32_accuracy.within_criterion(1e-5, 2.2e-5)
