"""Kovaleva et al. 2019 "Revealing the Dark Secrets of BERT", §3: attention-map pattern types.

`components.cnn` (CNN + preprocessing), `module` (LightningModule), `datamodule` (the hand-labelled
maps), `classify` (``python -m probes.patterns classify ...``). ``analysis=pattern_types``
(probes.analysis.kovaleva.pattern_types) types live maps with a trained CNN.
"""

from probes.patterns.components.cnn import CLASSES

__all__ = ["CLASSES"]
