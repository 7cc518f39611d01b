"""GLUE fine-tuning: the encoder's base model + dropout + a linear head (Kovaleva et al. 2019, §3).

`SequenceClassifier` takes an unfrozen copy of `Encoder.model` (train mode under fit), pools
the sequence with the encoder's **pooler** (tanh dense layer on the [CLS] hidden state, exactly
as `BertForSequenceClassification`; `pooling: cls` uses the raw [CLS] hidden state instead),
applies dropout and one linear layer: 2 logits with cross-entropy, or 1 score with MSE for STS-B.
AdamW (no weight decay on biases/LayerNorm) with linear warmup then linear decay to 0.

`freeze_encoder: true` is the "pre-trained without fine-tuning" baseline: the encoder (pooler
included) stays frozen and in eval mode, only the head trains (use a larger `head_lr`; the
`glue_<task>_frozen` experiments use 3e-2).

Metrics (`probes.glue.metrics`) are logged as `val/<m>`, `test/<m>` and the best validation value
of the main metric as `val/<main>_best`. The fine-tuned model can be exported in Hugging Face format
(`export_hf`): `AutoModelForSequenceClassification.from_pretrained(<dir>)` gives the same logits.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn

from probes.data.glue import task_spec
from probes.glue.metrics import predictions, task_metrics

log = logging.getLogger(__name__)

EXPORT_INFO = "glue_task.json"


class SequenceClassifier(pl.LightningModule):
    def __init__(self, encoder, task: str, lr: float = 2e-5, head_lr: float | None = None,
                 weight_decay: float = 0.01, warmup_ratio: float = 0.1, adam_eps: float = 1e-8,
                 dropout: float | None = None, freeze_encoder: bool = False, pooling: str = "pooler"):
        super().__init__()
        self.save_hyperparameters(ignore=["encoder"])
        self.spec = task_spec(task)
        self.task = self.spec.name
        self.hf_config = copy.deepcopy(encoder.config)
        self.tokenizer = encoder.tokenizer
        self.encoder_name = getattr(encoder, "name", "")
        self.encoder = copy.deepcopy(encoder.model)
        self.encoder.requires_grad_(not freeze_encoder)
        self.encoder.train(not freeze_encoder)  # Encoder.model is in eval mode; Lightning keeps submodule modes
        if pooling not in ("pooler", "cls"):
            raise ValueError(f"pooling must be 'pooler' or 'cls', got {pooling!r}")
        if pooling == "pooler" and getattr(self.encoder, "pooler", None) is None:
            raise ValueError("pooling='pooler' but the encoder has no pooler; use pooling: cls")
        if dropout is None:
            dropout = getattr(self.hf_config, "classifier_dropout", None)
            dropout = dropout if dropout is not None else getattr(self.hf_config, "hidden_dropout_prob", 0.1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(self.hf_config.hidden_size, self.spec.num_labels)
        std = getattr(self.hf_config, "initializer_range", 0.02)
        nn.init.normal_(self.head.weight, std=std)
        nn.init.zeros_(self.head.bias)
        self.val_metrics = task_metrics(self.task)
        self.test_metrics = task_metrics(self.task)
        self.best = float("-inf")
        self._loss_sum = {"val": 0.0, "test": 0.0}
        self._loss_n = {"val": 0, "test": 0}

    # ------------------------------------------------------------------ model
    def train(self, mode: bool = True):
        super().train(mode)
        if self.hparams.freeze_encoder:
            self.encoder.eval()  # frozen baseline: no dropout inside the encoder either
        return self

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, **_) -> torch.Tensor:
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        if self.hparams.pooling == "pooler":
            pooled = out.pooler_output
        else:
            pooled = out.last_hidden_state[:, 0]
        return self.head(self.dropout(pooled))

    def loss(self, logits, labels):
        if self.spec.num_labels == 1:
            return nn.functional.mse_loss(logits.squeeze(-1), labels.float())
        return nn.functional.cross_entropy(logits, labels)

    # ------------------------------------------------------------------ steps
    def training_step(self, batch, batch_idx):
        loss = self.loss(self(**batch), batch["labels"])
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=len(batch["labels"]))
        if self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)
        return loss

    def _eval_step(self, batch, split: str):
        logits = self(**batch)
        labels = batch["labels"]
        self._loss_sum[split] += float(self.loss(logits, labels)) * len(labels)
        self._loss_n[split] += len(labels)
        metrics = self.val_metrics if split == "val" else self.test_metrics
        metrics.update(predictions(self.task, logits), labels)

    def _eval_end(self, split: str) -> dict[str, float]:
        metrics = self.val_metrics if split == "val" else self.test_metrics
        values = {f"{split}/{k}": float(v) for k, v in metrics.compute().items()}
        metrics.reset()
        values[f"{split}/loss"] = self._loss_sum[split] / max(1, self._loss_n[split])
        self._loss_sum[split], self._loss_n[split] = 0.0, 0
        return values

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, "val")

    def on_train_start(self):
        self.encoder.train(not self.hparams.freeze_encoder)

    def on_validation_epoch_end(self):
        values = self._eval_end("val")
        main = values[f"val/{self.spec.main_metric}"]
        if not self.trainer.sanity_checking and main == main and main > self.best:  # main == main: not NaN
            self.best = main
        if self.best > float("-inf"):
            values[f"val/{self.spec.main_metric}_best"] = self.best
        self.log_dict(values, prog_bar=True)

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, "test")

    def on_test_epoch_end(self):
        self.log_dict(self._eval_end("test"))

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        from transformers import get_linear_schedule_with_warmup

        hp = self.hparams
        no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "LayerNorm.bias")
        groups = []
        named = [("encoder", self.encoder, hp.lr)] if not hp.freeze_encoder else []
        named.append(("head", self.head, hp.head_lr if hp.head_lr is not None else hp.lr))
        for _, module, lr in named:
            params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            groups.append({"params": [p for n, p in params if not n.endswith(no_decay)],
                           "weight_decay": hp.weight_decay, "lr": lr})
            groups.append({"params": [p for n, p in params if n.endswith(no_decay)], "weight_decay": 0.0, "lr": lr})
        groups = [g for g in groups if g["params"]]
        opt = torch.optim.AdamW(groups, lr=hp.lr, eps=hp.adam_eps)
        total = int(self.trainer.estimated_stepping_batches)
        sched = get_linear_schedule_with_warmup(opt, int(hp.warmup_ratio * total), total)
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
        base = getattr(model, model.base_model_prefix)
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
                    freeze_encoder=bool(self.hparams.freeze_encoder))
        (d / EXPORT_INFO).write_text(json.dumps(info, indent=1))
        log.info("saved Hugging Face model to %s", d)
        return d
