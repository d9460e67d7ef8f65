"""``ttt2la demo``: the committed trained character LM, converted at every implemented level.

The demo shows what conversion does to a model that has learned something: per level, the
conversion report, the next-byte loss on held-out standard-library text beside the original's,
and tokens/s side by side. Levels come from the pass registry, so a level whose passes are
written joins the demo without a change here. Every figure says which inputs it was measured on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from .as_written import CALLS_TO_DECIDE
from .errors import ConversionError, LevelNotImplementedError
from .passes.base import MAX_LEVEL, passes_for_level
from .testing import rel_rms_error


@dataclass(frozen=True)
class DemoSize:
    """How much held-out text the demo scores and times, and how long it times."""

    sequences: int          # held-out sequences: the loss rows and the timed batch (32 x 256
                            # are the rows the training script validated on)
    length: int             # bytes per sequence (the model was trained at 256)
    repeats: int            # at most this many timed rounds (at least 3) ...
    max_seconds: float      # ... or until this many seconds of timing have passed


DEMO_SIZES = {"default": DemoSize(32, 256, repeats=15, max_seconds=20.0),
              "quick": DemoSize(4, 128, repeats=5, max_seconds=5.0)}
#: Exit status when this Python has too little standard-library source to score on.
NO_HELD_OUT_TEXT = 2
#: Sequences of training text the lossy levels fold from and measure their drift on.
CALIBRATION_SEQUENCES = 4
#: Chunks of held-out text in the example the conversion traces and checks on.
EXAMPLE_CHUNKS = 4


def implemented_levels() -> list[int]:
    """The levels 0..6 whose passes all exist, as the pass registry reports them."""
    levels = []
    for level in range(MAX_LEVEL + 1):
        try:
            passes_for_level(level)
        except LevelNotImplementedError:
            continue
        levels.append(level)
    return levels


@dataclass
class Row:
    """One model of the comparison: the original or one conversion of it."""

    name: str
    model: torch.nn.Module | None
    report: object = None               # the ConversionReport of a conversion
    refused: str | None = None          # why the conversion was refused
    loss: float | None = None           # mean next-byte cross-entropy, nats
    logits_rms: float | None = None     # rel. RMS of the logits against the original's

    @property
    def lossy_passes(self) -> list[str]:
        """The applied passes that change the function, in step order, without repeats."""
        if self.report is None:
            return []
        names = []
        for layer in self.report.layers:
            for p in layer.passes:
                if p.status == "applied" and not p.exact and p.name not in names:
                    names.append(p.name)
        return names


def convert_levels(model: torch.nn.Module, levels: list[int], example: tuple,
                   progress, calibration: tuple | None = None) -> list[Row]:
    """One row per level: level 0 keeps a loop that is not reducible as written (strict=False);
    higher levels are strict. A refused conversion becomes a row that says why."""
    import ttt2la

    rows = []
    task = progress.add_task("converting", total=len(levels))
    for level in levels:
        progress.update(task, description=f"converting at level {level}")
        try:
            converted = ttt2la.convert(model, level=level, example_inputs=example,
                                       calibration=calibration, strict=level > 0)
            rows.append(Row(f"level {level}", converted, converted.ttt2la_report))
        except ConversionError as e:
            rows.append(Row(f"level {level}", None, refused=f"{type(e).__name__}: {e}"))
        progress.advance(task)
    return rows


def score(rows: list[Row], sequences: torch.Tensor) -> None:
    """Fill in each row's held-out loss and its logits' rel. RMS against the original's."""
    from .zoo.trained import next_token_loss

    inputs = sequences[:, :-1]
    with torch.no_grad():
        reference = rows[0].model(inputs)
        for row in rows:
            if row.model is None:
                continue
            row.loss = next_token_loss(row.model, sequences)
            if row is not rows[0]:
                row.logits_rms = rel_rms_error(row.model(inputs), reference)


def comparison_table(rows: list[Row], timings: dict, plans: dict, unigram: float,
                     shape: str, repeats: int, max_seconds: float) -> Table:
    """Loss, perplexity, exactness and tokens/s of every row, side by side."""
    base = rows[0]
    rounds = timings[base.name].rounds
    table = Table(title=f"held-out loss and throughput, on the same {shape} bytes of "
                        "standard-library files the model never trained on, "
                        f"{torch.get_num_threads()} threads",
                  caption=f"loss: next-byte cross-entropy, nats/byte (a unigram model fit to "
                          f"this very text: {unigram:.3f}); logits rel. RMS: against the "
                          f"original's on these inputs; tokens/s: median of {rounds} "
                          f"interleaved round{'s' * (rounds != 1)} after warm-up (at most "
                          f"{repeats}, time-boxed to {max_seconds:g} s); spread: IQR and "
                          "range of per-round times, % of the median; speed-up: median of "
                          "per-round ratios")
    for column, justify in (("model", "left"), ("exact", "left"), ("plan that ran", "left"),
                            ("loss", "right"), ("Δ loss", "right"), ("perplexity", "right"),
                            ("logits rel. RMS", "right"), ("tokens/s", "right"),
                            ("spread", "right"), ("speed-up", "right")):
        table.add_column(column, justify=justify)
    for row in rows:
        if row.model is None:
            table.add_row(row.name, "refused", row.refused or "", *[""] * 7)
            continue
        t = timings[row.name]
        first = row is base
        table.add_row(row.name, "" if first else ("yes" if row.report.exact else "no (lossy)"),
                      "as written" if first else plans[row.name],
                      f"{row.loss:.4f}", "" if first else f"{row.loss - base.loss:+.4f}",
                      f"{torch.tensor(row.loss).exp():.3f}",
                      "" if first else f"{row.logits_rms:.1e}",
                      f"{t.rate:,.0f}", t.spread(),
                      "1.00x" if first else str(t.speedup_over(timings[base.name])))
    return table


def level_summary(row: Row, base: Row, timings: dict, calibration_shape: str) -> str:
    """One line per level: exact, or lossy by design with the loss it costs, and where each
    figure was measured."""
    if row.model is None:
        return f"{row.name}: refused ({row.refused})"
    speed = timings[row.name].speedup_over(timings[base.name]).median
    delta = row.loss - base.loss
    if row.report.exact:
        return (f"{row.name}: exact — loss {delta:+.4f} nats/byte, logits rel. RMS "
                f"{row.logits_rms:.1e} on the held-out text, {speed:.2f}x the original's "
                "tokens/s")
    drift = "; ".join(_layer_drifts(row.report))
    passes = row.lossy_passes
    removed = (f"{', '.join(passes)} remove{'s' * (len(passes) == 1)} what the model was "
               "trained with")
    return (f"{row.name}: lossy by design ({removed}) — loss {delta:+.4f} nats/byte, logits "
            f"rel. RMS {row.logits_rms:.1e} on the held-out text, {speed:.2f}x the original's "
            f"tokens/s; the report's drift (each layer's output, on the {calibration_shape} "
            f"calibration text from training files): {drift}")


def _plan(text: str) -> str:
    """``ran_plans``' words, without repeating that a layer was kept as written."""
    from .report import KEPT_AS_WRITTEN

    return text.replace(f"recurrent on {KEPT_AS_WRITTEN}", "as written (recurrent)")


def _layer_drifts(report) -> list[str]:
    found = []
    for layer in report.layers:
        drifts = [p.drift for p in layer.passes if p.drift]
        if drifts:
            found.append(f"{layer.module_path} {drifts[-1]['rel_rms_error']:.1e}")
    return found


def run_demo(size: DemoSize, out: Console, err: Console, progress_factory, markdown: bool,
             print_report) -> int:
    """Load the trained model, convert it at every implemented level, score and time the rows."""
    from .cli import measure_timings, ran_plans
    from .zoo.trained import trained_char_lm, unigram_loss

    trained = trained_char_lm()
    model, card = trained.model, trained.card
    try:
        sequences = trained.validation_sequences(size.sequences, size.length)
    except (OSError, ValueError) as e:       # a Python install without (enough) library source
        err.print(f"ttt2la demo: no held-out text to score on: {e}", markup=False,
                  highlight=False)
        return NO_HELD_OUT_TEXT
    chunk = model.blocks[0].ttt.chunk_size
    example = (sequences[:1, : EXAMPLE_CHUNKS * chunk],)
    calibration = (trained.calibration_sequences(CALIBRATION_SEQUENCES),)
    calibration_shape = "x".join(map(str, calibration[0].shape))
    levels = implemented_levels()
    v = card["validation"]
    out.print(f"character-level LaCT language model trained on the Python standard library's "
              f"own source: {card['parameters']:,} parameters, {len(model.blocks)} LaCT "
              f"blocks, chunk {chunk}; {card['training']['steps']} steps on "
              f"{card['data']['train_files']} files (Python {card['data']['python']}); "
              f"validation loss {v['loss']:.4f} nats/byte at training time on "
              f"{v['sequences']}x{v['sequence_length']} held-out bytes (unigram "
              f"{v['unigram_loss']:.4f}; {v['loss_without_ttt_updates']:.4f} with the fast "
              f"weights never updated). Levels whose passes exist: "
              f"{', '.join(map(str, levels))}.", markup=False, highlight=False)

    with progress_factory(err) as progress:
        rows = [Row("original", model)] + convert_levels(model, levels, example, progress,
                                                         calibration)
    for row in rows[1:]:
        if row.report is not None:
            print_report(out, row.report, markdown)
            out.print()
    score(rows, sequences)
    inputs = (sequences[:, :-1],)
    live = {row.name: row.model for row in rows if row.model is not None}
    with progress_factory(err) as progress:
        # warm-up long enough for any race against the code as written to be decided
        timings = measure_timings(live, inputs, inputs[0].numel(), repeats=size.repeats,
                                  max_seconds=size.max_seconds, warmup=CALLS_TO_DECIDE,
                                  progress=progress)
    plans = {name: _plan(ran_plans(m, inputs[0].shape[0])) for name, m in live.items()}
    shape = f"{inputs[0].shape[0]}x{inputs[0].shape[1]}"
    out.print(comparison_table(rows, timings, plans, unigram_loss(sequences), shape,
                               size.repeats, size.max_seconds))
    out.print("summary:", markup=False)
    for row in rows[1:]:
        out.print(f"  {level_summary(row, rows[0], timings, calibration_shape)}", markup=False,
                  highlight=False, soft_wrap=True)
    return 0


__all__ = ["DemoSize", "DEMO_SIZES", "implemented_levels", "run_demo", "Row"]
