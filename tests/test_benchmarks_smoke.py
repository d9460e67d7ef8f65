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


@pytest.fixture
def throughput():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import throughput
        yield throughput
    finally:
        sys.path.remove(str(BENCHMARKS))


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
    assert markdown.count("| LaCT chunk 16, L=64, no Muon |") == 5 + 3


def test_cases_with_many_chunks_time_the_published_operator_eagerly(throughput, tmp_path):
    """Dynamo would unroll a loop of this many chunks; those rows run eagerly and say so."""
    out = tmp_path / "results"
    chunks = throughput.COMPILED_CHUNKS + 1
    assert throughput.main(["--size", "smoke", "--muon", "off", "--levels", "2",
                            "--lact", f"2x{2 * chunks}", "--per-token-lengths",
                            "--rounds", "1", "--threads", str(torch.get_num_threads()),
                            "--results", str(out)]) == 0
    rows = {r["model"]: r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())
            if r.get("kind") == "Row"}
    for name in ("original (level 0)", "variant 1 as written", "variant 2 as written"):
        assert rows[name]["plan"] == f"as written, run eagerly ({chunks} chunks, not compiled)"
        assert rows[name]["tokens_per_s"] > 0
    assert rows["level 2 converted"]["error"] <= rows["level 2 converted"]["bound"]
