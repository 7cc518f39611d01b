"""Messages of the libraries that a run of the project can do nothing about, silenced narrowly (each by its
message, and category or logger) in this one place; installed on ``import probes``, so in every process of a run
(the extraction child, DDP ranks, sweep workers included). What the project causes itself is fixed where it is
caused instead (e.g. :class:`probes.extract.writer.CacheWriter` is a plain callback, so Lightning has no batch
indices to warn about; :class:`probes.report.tracking.WandbRunLogger` does not pass wandb the ``anonymous`` key).
"""

from __future__ import annotations

import logging
import re
import warnings

# Lightning's advertisements, logged at every Trainer (four in a smoke run): "💡 Tip: ... try installing litlogger"
TIP_PREFIX = "💡 Tip: "
# the loggers Lightning's rank_zero_info writes through (which one depends on the import order)
TIP_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero",
               "lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
               "lightning_utilities.core.rank_zero")
# torch deprecates what Lightning's own pytree helper still calls, at every fit and predict loop
LEAFSPEC = re.escape("`isinstance(treespec, LeafSpec)` is deprecated")


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(TIP_PREFIX)


def install() -> None:
    """Add the filters (again: no filter is added twice)."""
    warnings.filterwarnings("ignore", message=LEAFSPEC, category=FutureWarning)
    for name in TIP_LOGGERS:
        logger = logging.getLogger(name)
        if _not_a_tip not in logger.filters:
            logger.addFilter(_not_a_tip)


install()
