"""GLUE fine-tuning: the encoder's base model + dropout + a linear head (Kovaleva et al. 2019, §3).

`SequenceClassifier` takes an unfrozen copy of `Encoder.base` (the encoder without any head; any
supported family), pools the sequence with the encoder's **pooler** (tanh dense layer on the [CLS]
hidden state, exactly as `BertForSequenceClassification`; `pooling: cls` uses the raw [CLS] hidden
state instead, required for families without a pooler: DistilBERT, ELECTRA, DeBERTa-v2, ModernBERT),
applies dropout and one linear layer: 2 logits with cross-entropy, or 1 score with MSE for STS-B.

Optimisation, as every LightningModule of the project (see `probes.dependency.module`): `optimizer`
and `scheduler` are partials from the config (`conf/probe/sequence_classifier.yaml`: AdamW, lr 2e-5,
weight decay 0.01; `transformers.get_linear_schedule_with_warmup`). The module builds the parameter
groups (no weight decay on biases/LayerNorm; `head_lr` for the head when set) and gives the
scheduler `num_warmup_steps = warmup_ratio * total` and `num_training_steps = total` (stepped every
optimizer step).

Layer-wise learning rates (ULMFiT's discriminative fine-tuning; `layer_decay`, default 1.0): the
parameters of encoder layer l (0 = embeddings, 1..L = blocks, L = ``config.num_hidden_layers``;
layers from :func:`probes.model.layers.parameter_layers`) train at ``lr * layer_decay ** (L - l)``;
the pooler and the head at the full lr (``head_lr`` still applies to the head). ``layer_decay: 1.0``
builds exactly the groups of a run without the option. Per-layer gradient norms:
`probes.glue.callbacks.GradNormLog`.

`freeze_encoder: true` is the "pre-trained without fine-tuning" baseline: the encoder (pooler
included) stays frozen and in eval mode, only the head trains (use a larger `head_lr`; the
`glue_<task>_frozen` experiments use 3e-2).

Metrics (`probes.glue.metrics`, torchmetrics per split) are logged as `train/<m>`, `val/<m>`,
`test/<m>` and the best validation value of the main metric as `val/<main>_best`. The fine-tuned model
can be exported in Hugging Face format (`export_hf`): `AutoModelForSequenceClassification
.from_pretrained(<dir>)` gives the same logits.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Callable

import pytorch_lightning as pl
import torch
from torch import nn
from torchmetrics import MaxMetric, MeanMetric

from probes.data.glue import task_spec
from probes.glue.metrics import predictions, task_metrics
from probes.model import hooks
from probes.model.load import EXPORT_INFO

log = logging.getLogger(__name__)

NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight", "LayerNorm.bias", "layer_norm.bias", "norm.weight",
            "norm.bias")
# optimizer settings of checkpoints written before `optimizer` came from the config (ignored when loading)
LEGACY_OPTIMIZER_HPARAMS = ("lr", "weight_decay", "adam_eps")
SPLITS = ("train", "val", "test")


class SequenceClassifier(pl.LightningModule):
    def __init__(self, encoder, task: str, optimizer: Callable | None = None, scheduler: Callable | None = None,
                 head_lr: float | None = None, warmup_ratio: float = 0.1, dropout: float | None = None,
                 freeze_encoder: bool = False, pooling: str = "pooler", layer_decay: float = 1.0, **legacy):
        super().__init__()
        unknown = sorted(set(legacy) - set(LEGACY_OPTIMIZER_HPARAMS))
        if unknown:
            raise TypeError(f"SequenceClassifier got unexpected arguments {unknown}")
        if legacy and optimizer is not None:
            raise ValueError(f"{sorted(legacy)} moved into the optimizer partial: set probe.optimizer.lr / "
                             f"probe.optimizer.weight_decay / probe.optimizer.eps")
        self.save_hyperparameters(ignore=["encoder", "optimizer", "scheduler", "legacy"])
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.spec = task_spec(task)
        self.task = self.spec.name
        self.hf_config = copy.deepcopy(encoder.config)
        self.tokenizer = encoder.tokenizer
        self.encoder_name = getattr(encoder, "name", "")
        self.encoder = copy.deepcopy(encoder.base)  # the encoder without its head (e.g. BertModel)
        self.encoder.requires_grad_(not freeze_encoder)
        self.encoder.train(not freeze_encoder)  # Encoder.model is in eval mode; Lightning keeps submodule modes
        if not layer_decay > 0:
            raise ValueError(f"layer_decay must be > 0, got {layer_decay}")
        if pooling not in ("pooler", "cls"):
            raise ValueError(f"pooling must be 'pooler' or 'cls', got {pooling!r}")
        if pooling == "pooler" and getattr(self.encoder, "pooler", None) is None:
            raise ValueError(f"pooling='pooler' but {type(self.encoder).__name__} has no pooler; set probe.pooling=cls "
                             f"(the raw [CLS] hidden state)")
        if dropout is None:
            dropout = getattr(self.hf_config, "classifier_dropout", None)
            dropout = dropout if dropout is not None else getattr(self.hf_config, "hidden_dropout_prob", 0.1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(self.hf_config.hidden_size, self.spec.num_labels)
        std = getattr(self.hf_config, "initializer_range", 0.02)
        nn.init.normal_(self.head.weight, std=std)
        nn.init.zeros_(self.head.bias)
        self.train_metrics, self.val_metrics, self.test_metrics = (
            task_metrics(self.task).clone(prefix=f"{s}/") for s in SPLITS)
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_best = MaxMetric()

    # ------------------------------------------------------------------ model
    def train(self, mode: bool = True):
        super().train(mode)
        if self.hparams.freeze_encoder:
            self.encoder.eval()  # frozen baseline: no dropout inside the encoder either
        return self

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, **_) -> torch.Tensor:
        """(B, T) ids, mask and token types (dropped for families without them) -> (B, num_labels) logits."""
        out = self.encoder(**hooks.model_inputs(self.encoder, input_ids=input_ids, attention_mask=attention_mask,
                                                token_type_ids=token_type_ids))
        if self.hparams.pooling == "pooler":
            pooled = out.pooler_output  # (B, D)
        else:
            pooled = out.last_hidden_state[:, 0]  # (B, D)
        return self.head(self.dropout(pooled))

    def loss(self, logits, labels):
        if self.spec.num_labels == 1:
            return nn.functional.mse_loss(logits.squeeze(-1), labels.float())
        return nn.functional.cross_entropy(logits, labels)

    # ------------------------------------------------------------------ steps
    def training_step(self, batch, batch_idx):
        logits = self(**batch)
        labels = batch["labels"]
        loss = self.loss(logits, labels)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=len(labels),
                 sync_dist=True)  # DDP: the mean over processes
        self.train_metrics.update(predictions(self.task, logits.detach()), labels)
        if self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)
        return loss

    def on_train_epoch_end(self):
        self.log_dict(self._compute(self.train_metrics), sync_dist=True)

    def _eval_step(self, batch, split: str):
        logits = self(**batch)
        labels = batch["labels"]
        getattr(self, f"{split}_loss").update(self.loss(logits, labels), weight=len(labels))
        getattr(self, f"{split}_metrics").update(predictions(self.task, logits), labels)

    @staticmethod
    def _compute(metrics) -> dict[str, float]:
        values = {k: float(v) for k, v in metrics.compute().items()}
        metrics.reset()
        return values

    def _eval_end(self, split: str) -> dict[str, float]:
        values = self._compute(getattr(self, f"{split}_metrics"))
        loss = getattr(self, f"{split}_loss")
        values[f"{split}/loss"] = float(loss.compute()) if loss.update_count else float("nan")
        loss.reset()
        return values

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, "val")

    def on_train_start(self):
        self.encoder.train(not self.hparams.freeze_encoder)

    def on_validation_epoch_end(self):
        values = self._eval_end("val")
        main = values[f"val/{self.spec.main_metric}"]
        if not self.trainer.sanity_checking and main == main:  # main == main: not NaN
            self.val_best.update(main)
        if self.val_best.update_count:
            values[f"val/{self.spec.main_metric}_best"] = float(self.val_best.compute())
        self.log_dict(values, prog_bar=True, sync_dist=True)  # computed from synced metric states: equal on all ranks

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, "test")

    def on_test_epoch_end(self):
        self.log_dict(self._eval_end("test"), sync_dist=True)

    # ------------------------------------------------------------------ optimisation
    def encoder_layers(self) -> dict[str, int]:
        """``{encoder parameter name: layer}``: 0 embeddings, 1..L blocks, L + 1 pooler / final norm
        (:func:`probes.model.layers.parameter_layers`, found once)."""
        if getattr(self, "_encoder_layers", None) is None:
            from probes.model.layers import parameter_layers

            self._encoder_layers = parameter_layers(self.encoder)
        return self._encoder_layers

    def layer_lr_scale(self, layer: int) -> float:
        """``layer_decay ** (L - layer)`` for layers 0..L; 1 above L (pooler, final norm)."""
        L = int(self.hf_config.num_hidden_layers)
        return float(self.hparams.get("layer_decay", 1.0)) ** max(L - layer, 0)

    def param_groups(self) -> list[dict]:
        """Encoder and head parameters, each split into decayed and not decayed (biases, norms; weight
        decay 0). Decayed groups take the optimizer's weight decay; the head's groups ``head_lr``
        when set, the others the optimizer's lr. With ``layer_decay != 1`` the encoder's groups are
        split further by layer, each with a ``layer`` key (its lr is set by :meth:`configure_optimizers`)."""
        hp = self.hparams
        decay = float(hp.get("layer_decay", 1.0))
        parts = []
        if not hp.freeze_encoder:
            named = [(n, p) for n, p in self.encoder.named_parameters() if p.requires_grad]
            if decay == 1.0:
                parts.append((named, {}))
            else:  # configure_optimizers scales each group's lr by layer_lr_scale(layer)
                layers = self.encoder_layers()
                for l in sorted({layers[n] for n, _ in named}):
                    parts.append(([(n, p) for n, p in named if layers[n] == l], {"layer": l}))
        head_named = [(n, p) for n, p in self.head.named_parameters() if p.requires_grad]
        parts.append((head_named, {"lr": hp.head_lr} if hp.head_lr is not None else {}))
        groups = []
        for params, extra in parts:
            groups.append({"params": [p for n, p in params if not n.endswith(NO_DECAY)], **extra})
            groups.append({"params": [p for n, p in params if n.endswith(NO_DECAY)], "weight_decay": 0.0, **extra})
        return [g for g in groups if g["params"]]

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError("SequenceClassifier needs an optimizer partial to train (probe.optimizer)")
        opt = self.optimizer_factory(params=self.param_groups())
        for g in opt.param_groups:  # layer-wise lr: lr * layer_decay ** (L - layer), before the scheduler reads it
            if "layer" in g:
                g["lr"] = g["lr"] * self.layer_lr_scale(g["layer"])
        if self.scheduler_factory is None:
            return opt
        total = int(self.trainer.estimated_stepping_batches)
        sched = self.scheduler_factory(optimizer=opt, num_warmup_steps=int(self.hparams.warmup_ratio * total),
                                       num_training_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------ export
    def to_hf(self, state_dict: dict | None = None):
        """A `*ForSequenceClassification` model (eager attention) with this encoder and head.

        `state_dict`: a Lightning checkpoint's `state_dict` (e.g. the best epoch) instead of the
        current weights. Requires `pooling='pooler'` and an architecture whose classification head
        is pooler -> dropout -> `classifier` Linear (BERT-family); raises otherwise.
        """
        from transformers import AutoModelForSequenceClassification

        if self.hparams.pooling != "pooler":
            raise ValueError("to_hf needs pooling='pooler' (BertForSequenceClassification uses the pooler)")
        cfg = copy.deepcopy(self.hf_config)
        cfg.num_labels = self.spec.num_labels
        cfg.problem_type = "regression" if self.spec.num_labels == 1 else "single_label_classification"
        cfg.finetuning_task = self.task
        cfg.classifier_dropout = self.dropout.p
        cfg.architectures = None
        model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager")
        base = model.base_model
        clf = getattr(model, "classifier", None)
        if not isinstance(clf, nn.Linear) or clf.weight.shape != self.head.weight.shape:
            raise ValueError(f"{type(model).__name__} has no compatible `classifier` Linear")
        if state_dict is None:
            enc_sd, head_sd = self.encoder.state_dict(), self.head.state_dict()
        else:
            enc_sd = {k[len("encoder."):]: v for k, v in state_dict.items() if k.startswith("encoder.")}
            head_sd = {k[len("head."):]: v for k, v in state_dict.items() if k.startswith("head.")}
        base.load_state_dict(enc_sd, strict=True)
        clf.load_state_dict(head_sd, strict=True)
        model.config.architectures = [type(model).__name__]
        return model.eval()

    def export_hf(self, dirpath: str | Path, state_dict: dict | None = None) -> Path:
        """Save model + tokenizer with `save_pretrained` (+ `glue_task.json`); returns the folder."""
        d = Path(dirpath)
        d.mkdir(parents=True, exist_ok=True)
        try:
            model = self.to_hf(state_dict)
            model.save_pretrained(d)
        except ValueError as e:  # incompatible head: save the encoder and the head weights separately
            log.warning("saving encoder + head.pt, not a *ForSequenceClassification model: %s", e)
            sd = state_dict or self.state_dict()
            enc = copy.deepcopy(self.encoder)
            enc.load_state_dict({k[8:]: v for k, v in sd.items() if k.startswith("encoder.")})
            enc.save_pretrained(d)
            torch.save({k[5:]: v for k, v in sd.items() if k.startswith("head.")}, d / "head.pt")
        self.tokenizer.save_pretrained(d)
        info = dict(task=self.task, num_labels=self.spec.num_labels, main_metric=self.spec.main_metric,
                    pooling=self.hparams.pooling, encoder=self.encoder_name,
                    freeze_encoder=bool(self.hparams.freeze_encoder), layer_decay=float(self.hparams.layer_decay))
        (d / EXPORT_INFO).write_text(json.dumps(info, indent=1))
        log.info("saved Hugging Face model to %s", d)
        return d
