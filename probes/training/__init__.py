"""What the trainable packages share: the LightningModule base (:mod:`probes.training.module`) and the
treebank datamodule base (:mod:`probes.training.datamodule`)."""
