"""Kovaleva et al. 2019 "Revealing the Dark Secrets of BERT", §3: attention-map pattern types.

`model` (CNN + preprocessing), `module` (LightningModule), `datamodule` (the hand-labelled maps),
`classify` (``python -m probes.patterns classify ...``), `attention` (live wordpiece attention of
GLUE/treebank inputs, pre-trained or fine-tuned encoder) used by ``analysis=pattern_types`` and
``analysis=linguistic_attention``.
"""

from probes.patterns.components.cnn import CLASSES

__all__ = ["CLASSES"]
