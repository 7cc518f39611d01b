"""Per-task GLUE metrics (torchmetrics): CoLA MCC, SST-2/RTE/QNLI/WNLI accuracy, MRPC/QQP F1 + accuracy,
STS-B Pearson/Spearman, MNLI 3-class accuracy.

All metrics are fractions (not percentages). Classification metrics take the argmax class
(label 1 = positive class for F1: MRPC "paraphrase"); STS-B takes the raw regression output.
"""

from __future__ import annotations

import torch
from torchmetrics import Accuracy, F1Score, MetricCollection, PearsonCorrCoef, SpearmanCorrCoef
from torchmetrics.classification import BinaryMatthewsCorrCoef

from probes.data.glue import task_spec


class MatthewsCorrCoef(BinaryMatthewsCorrCoef):
    """Binary MCC that is 0 when the labels or the predictions are all one class (as in scikit-learn
    and the GLUE scorer); torchmetrics returns an eps-based nonzero value there (0.47 for 8 of 10
    labels right with a constant prediction)."""

    def compute(self) -> torch.Tensor:
        cm = self.confmat  # (2, 2) [label, prediction]
        if (cm.sum(0) == 0).any() or (cm.sum(1) == 0).any():
            return torch.zeros((), device=cm.device)
        return super().compute()


def task_metrics(task: str) -> MetricCollection:
    """A fresh MetricCollection whose keys are the task's metric names (`TaskSpec.metrics`)."""
    name = task_spec(task).name
    if name == "cola":
        m = {"mcc": MatthewsCorrCoef()}
    elif name in ("sst2", "rte", "qnli", "wnli"):
        m = {"acc": Accuracy(task="binary")}
    elif name == "mnli":
        m = {"acc": Accuracy(task="multiclass", num_classes=3, average="micro")}
    elif name in ("mrpc", "qqp"):
        m = {"f1": F1Score(task="binary"), "acc": Accuracy(task="binary")}
    elif name == "stsb":
        m = {"pearson": PearsonCorrCoef(), "spearman": SpearmanCorrCoef()}
    else:  # pragma: no cover
        raise ValueError(task)
    return MetricCollection(m)


def predictions(task: str, logits: torch.Tensor) -> torch.Tensor:
    """Class ids (argmax) or, for the regression task, the scores (`logits[:, 0]`)."""
    if task_spec(task).num_labels == 1:
        return logits.reshape(logits.shape[0], -1)[:, 0].float()
    return logits.argmax(-1)


def score(task: str, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Every metric of `task` on one set of model outputs, as floats."""
    m = task_metrics(task)
    preds = predictions(task, logits.detach().cpu())
    labels = labels.detach().cpu()
    m.update(preds, labels.float() if task_spec(task).num_labels == 1 else labels.long())
    return {k: float(v) for k, v in m.compute().items()}
