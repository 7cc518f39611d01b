"""Lightning callbacks for GLUE fine-tuning."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pandas as pd
import pytorch_lightning as pl
import torch

from probes.glue.export import export_hf
from probes.io import atomic_write
from probes.training.checkpoint import load_checkpoint

log = logging.getLogger(__name__)


class HFExport(pl.Callback):
    """At the end of fit, save the best checkpoint's weights (or the final ones when there is no
    checkpoint) as a Hugging Face `*ForSequenceClassification` folder (:func:`probes.glue.export.export_hf`)."""

    def __init__(self, dirpath: str, use_best: bool = True):
        self.dirpath, self.use_best = Path(dirpath), use_best

    def on_fit_end(self, trainer: pl.Trainer, pl_module) -> None:
        if trainer.global_rank != 0 or trainer.sanity_checking:
            return
        state = None
        ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        if self.use_best and ckpt:
            state = load_checkpoint(ckpt, map_location="cpu", mmap=False)["state_dict"]
            log.info("exporting the best checkpoint %s", ckpt)
        export_hf(pl_module, self.dirpath, state_dict=state)


class ProgressLog(pl.Callback):
    """Plain log lines (`<run dir>/train.log`) every `every_n_steps` training steps and after each
    validation: step/total, epoch, loss, elapsed and estimated remaining time. The progress bar
    stays on; this is for runs whose output goes to a file."""

    def __init__(self, every_n_steps: int = 20):
        self.every = max(1, int(every_n_steps))
        self.t0 = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0 = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every or self.t0 is None:
            return
        total = int(trainer.estimated_stepping_batches)
        el = time.time() - self.t0
        loss = trainer.callback_metrics.get("train/loss_step")
        log.info("step %d/%d (epoch %d) loss %s, %.0fs elapsed, ~%.0fs left", step, total, trainer.current_epoch,
                 f"{float(loss):.4f}" if loss is not None else "-", el, el / max(step, 1) * (total - step))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        vals = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        log.info("epoch %d validation: %s", trainer.current_epoch, vals)


class GradNormLog(pl.Callback):
    """Per-layer gradient L2 norms of the module being fine-tuned, every optimizer step (before
    clipping), logged as ``grad_norm/layer_<l>`` (0 embeddings, 1..L blocks, L + 1 pooler / final norm;
    :meth:`SequenceClassifier.encoder_layers`) and ``grad_norm/head``; after each training epoch the
    per-epoch mean, std and maximum over steps go to ``<dirpath>/<filename>`` (tidy CSV: epoch, group,
    layer, steps, mean, std, max; rewritten atomically with every epoch so far)."""

    def __init__(self, dirpath: str, filename: str = "grad_norms.csv", log_every_n_steps: int = 1):
        self.path = Path(dirpath) / filename
        self.every = max(1, int(log_every_n_steps))
        self.rows: list[dict] = []
        self._steps: list[torch.Tensor] = []   # per step: (G,) norms of self._groups
        self._groups: list[tuple[str, int | None, list[torch.nn.Parameter]]] | None = None

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._groups is None:
            self._groups = layer_groups(pl_module)
        norms = group_grad_norms([ps for _, _, ps in self._groups])  # (G,)
        self._steps.append(norms)
        if trainer.global_step % self.every == 0:
            pl_module.log_dict({f"grad_norm/{label}": float(v) for (label, _, _), v in zip(self._groups, norms)},
                               on_step=True, on_epoch=False)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self._steps or self._groups is None:
            return
        steps = torch.stack(self._steps).double()  # (S, G)
        self._steps = []
        for (label, layer, _), col in zip(self._groups, steps.T):
            self.rows.append(dict(epoch=trainer.current_epoch, group=label, layer=layer, steps=len(col),
                                  mean=float(col.mean()), std=float(col.std()) if len(col) > 1 else 0.0,
                                  max=float(col.max())))
        if trainer.global_rank == 0:
            df = pd.DataFrame(self.rows)
            atomic_write(self.path, lambda tmp: df.to_csv(tmp, index=False))
            log.info("gradient norms of epoch %d -> %s", trainer.current_epoch, self.path)


def layer_groups(pl_module) -> list[tuple[str, int | None, list[torch.nn.Parameter]]]:
    """``(label, layer, trainable parameters)`` of a :class:`SequenceClassifier`: ``layer_<l>`` for the
    encoder's layers 0..L+1 (:meth:`SequenceClassifier.encoder_layers`), then ``head`` (layer None)."""
    by_name = dict(pl_module.encoder.named_parameters())
    layers: dict[int, list] = {}
    for name, l in pl_module.encoder_layers().items():
        if by_name[name].requires_grad:
            layers.setdefault(l, []).append(by_name[name])
    groups = [(f"layer_{l}", l, ps) for l, ps in sorted(layers.items())]
    head = [p for p in pl_module.head.parameters() if p.requires_grad]
    return groups + ([("head", None, head)] if head else [])


@torch.no_grad()
def group_grad_norms(groups: list[list[torch.nn.Parameter]]) -> torch.Tensor:
    """(G,) float64 L2 norm of the gradients of each parameter group (0 where none has a gradient), on CPU."""
    out = torch.zeros(len(groups), dtype=torch.float64)
    for g, params in enumerate(groups):
        sq = [p.grad.detach().double().pow(2).sum() for p in params if p.grad is not None]
        if sq:
            out[g] = torch.stack(sq).sum().sqrt().cpu()
    return out
