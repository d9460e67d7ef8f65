"""The errors ttt2la raises: each says what was found, where, and what to do."""
from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (empty where it has none): another library's error,
    quoted inside one of ours, may run for many lines."""
    return (str(error).strip().splitlines() or [""])[0]


class ConversionError(Exception):
    """Base class: a model could not be analysed or converted as asked."""


class UnsupportedTTTError(ConversionError):
    """The model has no test-time-training loop ttt2la understands, or one it cannot lower."""


class PlanFallbackError(UnsupportedTTTError):
    """The plan chosen at conversion could not run at a new shape, and ``strict=True`` refuses
    to run another one in its place."""


class PartialChunkError(UnsupportedTTTError):
    """A call whose last chunk is partial, where padding it with zeros would change the result
    (a mean over the chunk, attention across its tokens): the plan cannot run it. An exact
    conversion runs its code as written for such a call instead; a lossy one raises this."""

    def __init__(self, message: str, *, what: str = "", where: str | None = None):
        super().__init__(message)
        self.what = what        # what the padding would change, in words
        self.where = where      # the loop's source line


class ChangedAttributeError(UnsupportedTTTError):
    """A plain attribute of a lossily converted layer (a step size, a chunk size, a switch)
    changed since conversion: its graphs hold the value it was traced with, and the code as
    written computes another function. Convert the layer again."""

    def __init__(self, message: str, *, attribute: str = "", then=None, now=None):
        super().__init__(message)
        self.attribute = attribute      # "eta", or "blocks.0.ttt.chunk_size" from the layer
        self.then = then                # its value at conversion
        self.now = now                  # its value at the call


class SideEffectError(UnsupportedTTTError):
    """A layer's forward assigns an attribute of itself or of a submodule (a cache, a logged
    loss): a converted layer computes its output only and would not make that write."""

    def __init__(self, message: str, *, attribute: str = "", where: str | None = None):
        super().__init__(message)
        self.attribute = attribute
        self.where = where              # the assignment's source line, when found


class LaggedStateError(UnsupportedTTTError):
    """A loop reads a value made two or more iterations back (the fast weights before the last
    update, kept as ``Wp, W = W, W + dW`` or read from a list of every state): a chunk-parallel
    plan carries each state from one iteration to the next only, so the layer is not converted
    and runs as written inside a model. ``where`` is the reading line (``file:line``), ``value``
    the value read, by its name or line, and ``lag`` how many iterations back it was made."""

    def __init__(self, message: str, *, where: str | None = None, value: str = "",
                 lag: int = 2):
        super().__init__(message)
        self.where = where
        self.value = value
        self.lag = lag


class UnsupportedShapeError(ConversionError):
    """A converted layer was called at a shape, or with arguments, its conversion does not
    cover: the layer's own code ran only at some batch sizes when it was traced, a plain Python
    argument has another value than the one built into its graphs, or the call passes an
    argument its forward does not take (the message names it)."""


class NonReducibleError(ConversionError):
    """A state update is not associative at the requested level, so it cannot run in parallel.

    ``op`` is the torch call that breaks associativity ("`torch.sigmoid`"), ``where`` its user
    source location (``file:line``), ``state`` the carried state it updates and ``remedy`` the
    pass that removes it.
    """

    def __init__(self, message: str, *, state: str | None = None, op: str | None = None,
                 where: str | None = None, remedy: str | None = None):
        super().__init__(message)
        self.state = state
        self.op = op
        self.where = where
        self.remedy = remedy


class LevelNotImplementedError(ConversionError, NotImplementedError):
    """A simplification level whose passes do not exist yet was requested."""


class StreamingError(ConversionError):
    """A converted layer cannot continue a sequence from a previous call's state as asked: its
    code outside the loop mixes tokens across the sequence, the state belongs to another layer
    or batch size, or a piece ends where the layer's outputs are not final yet."""


class UnsupportedExportError(ConversionError):
    """``torch.export`` cannot trace this converted layer's plan (one that takes an affine
    update's coefficients by forward-mode differentiation, or one export's tracing fails on):
    export the original model instead, or run the converted layer eagerly or compiled."""


class CompileError(ConversionError):
    """``convert(compile=...)`` asked for a converted layer's plan under ``torch.compile``, and
    the backend failed on it at the example inputs (on a CPU, inductor needs a C++ compiler):
    convert without ``compile``, or with another backend."""


class AlreadyConvertedError(ConversionError):
    """The model handed to ``convert`` or ``inspect`` is already a converted model."""


class RejectedCallError(ConversionError):
    """The layer's own code, run inside the converted layer, failed on a call: an input of
    another dtype than the weights, an empty axis a reshape cannot infer. The layer as written
    fails on it too. The error raised is also an instance of the original error's class, which
    is chained as its ``__cause__``; ``where`` is the user source line that failed."""

    def __init__(self, message: str, *, where: str | None = None):
        super().__init__(message)
        self.where = where
