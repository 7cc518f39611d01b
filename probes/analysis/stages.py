"""The three stages of the long analyses (:mod:`probes.analysis.kovaleva.linguistic_attention`,
:mod:`probes.analysis.pascual.attribution`, :mod:`probes.analysis.kovaleva.pattern_types`,
:mod:`probes.analysis.beyond.faithfulness`), said once here; each module's ``save`` docstring names only
its own files.

1. ``compute(ctx, ...) -> <Name>Result``: the numbers, from the model and the data; writes none of the run's
   files (a module's doc names what it may write on the way: pattern_types a prediction cache, faithfulness
   the ``.partial.csv`` of a running task).
2. ``tables(result) -> <Name>Tables``: the result as data frames (a dataclass of them); writes no file.
3. ``save(ctx, result, frames, started) -> None``, the :class:`Save` contract: writes into ``ctx.output_dir``,
   each file atomically through the context, the tables of ``frames`` (``ctx.save_table``: ``<name>.csv``),
   the figures drawn from them (``ctx.save_figure``: ``<name>.png``; none when the context writes no
   figures) and ``summary.json`` (``ctx.log_summary``: the run's settings, its headline numbers and
   ``seconds``, the time since ``started``).

The configured entry (the ``_target_`` of ``conf/analysis/<name>.yaml``) takes ``started = time.time()``, runs
the three in order and returns one of the tables.
"""

from __future__ import annotations

from typing import Any, Protocol


class Save(Protocol):
    """Stage 3 of a long analysis: write the tables, the figures and ``summary.json`` (the module doc)."""

    def __call__(self, ctx: Any, result: Any, frames: Any, started: float) -> None:
        """Write into ``ctx.output_dir``.

        Args:
            ctx: The analysis context (:class:`probes.analysis.context.AnalysisContext`).
            result: What the module's ``compute`` returned.
            frames: What the module's ``tables`` made of ``result``.
            started: ``time.time()`` at the start of the run (the summary's ``seconds``).
        """
