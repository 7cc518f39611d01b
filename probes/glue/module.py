"""GLUE fine-tuning: the encoder's base model + dropout + a linear head (Kovaleva et al. 2019, §3).

`SequenceClassifier` takes an unfrozen copy of `Encoder.base` (the encoder without any head; any
supported family), pools the sequence with the encoder's **pooler** (tanh dense layer on the [CLS]
hidden state, exactly as `BertForSequenceClassification`; `pooling: cls` uses the raw [CLS] hidden
state instead, required for families without a pooler: DistilBERT, ELECTRA, DeBERTa-v2, ModernBERT),
applies dropout and one linear layer: 2 logits with cross-entropy, or 1 score with MSE for STS-B.

Causal LMs (the model layer's ``encoder.family.causal``) pool the **last real token** of each right-padded
row (``pooling: last``, the only pooling that sees the whole sequence: a decoder's first token sees only
itself), whatever ``pooling`` says (``cls`` is an error), and their head is a Linear without bias, as
transformers' ``*ForSequenceClassification`` of decoders (``score``), so the export is one of those. The
tokenizer's pad token (the model layer gives tokenizers without one their EOS) pads the batches.

Optimisation, as every LightningModule of the project (:class:`probes.training.module.ProbeModule`): `optimizer`
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
`test/<m>` and the best validation value of the monitored metric (`probe.monitor`, default the task's
main metric) as `<monitor>_best`, e.g. `val/f1_best`; conventions shared with every trainable module:
:class:`probes.training.module.ProbeModule`. The fine-tuned model is exported in Hugging Face format
by :mod:`probes.glue.export` (`AutoModelForSequenceClassification.from_pretrained(<dir>)` gives the same
logits), which also reads it back.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from probes.data.glue import task_spec
from probes.glue.metrics import predictions, task_metrics
from probes.model import structure
from probes.model.layers import parameter_layers
from probes.training.module import SPLITS, ProbeModule

NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight", "LayerNorm.bias", "layer_norm.bias", "norm.weight",
            "norm.bias")
# hyperparameters SequenceClassifier does not take -> the config key that sets them (the optimizer partial)
OPTIMIZER_KEYS = {"lr": "probe.optimizer.lr", "weight_decay": "probe.optimizer.weight_decay",
                  "adam_eps": "probe.optimizer.eps"}


def classification_pooling(encoder, pooling: str) -> str:
    """The pooling a classifier on ``encoder`` uses: ``last`` for causal LMs (``pooler``, the config default,
    becomes ``last``; ``cls`` is an error), ``pooling`` itself for encoders (``pooler`` or ``cls``)."""
    if pooling not in ("pooler", "cls", "last"):
        raise ValueError(f"pooling must be 'pooler', 'cls' or 'last', got {pooling!r}")
    if encoder.family.causal:
        if pooling == "cls":
            raise ValueError(f"probe.pooling=cls on a causal LM ({encoder.family.model_type}): its first token sees "
                             "only itself; decoders pool the last real token (probe.pooling=last)")
        return "last"
    if pooling == "last":
        raise ValueError(f"probe.pooling=last is for causal LMs; {encoder.family.model_type} is an encoder "
                         "(pooler or cls)")
    return pooling


def pool(out, pooling: str, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, D) sequence vectors of a base model's output: its pooler output, the hidden state at position 0
    (``cls``), or at the last real token of each right-padded row (``last``; all tokens without a mask)."""
    if pooling == "pooler":
        return out.pooler_output  # (B, D)
    hidden = out.last_hidden_state  # (B, T, D)
    if pooling == "cls":
        return hidden[:, 0]
    B, T = hidden.shape[:2]
    if attention_mask is None:
        return hidden[:, -1]
    positions = torch.arange(T, device=hidden.device)  # (T,)
    last = (positions * attention_mask.to(hidden.device).long()).argmax(-1)  # (B,) rightmost real token
    return hidden[torch.arange(B, device=hidden.device), last]  # (B, D)


class SequenceClassifier(ProbeModule):
    """The encoder's base model + pooling + dropout + a linear head, fine-tuned on one GLUE task.

    Args:
        encoder: the pre-trained :class:`probes.model.load.Encoder` (its base model is copied, unfrozen).
        task: the GLUE task (``probes.data.glue.task_spec``): number of labels, metrics, main metric.
        optimizer, scheduler, mode, scheduler_monitor: see :class:`~probes.training.module.ProbeModule`.
        monitor: the validation metric kept as best; None: ``val/<the task's main metric>``.
        head_lr: lr of the head's parameter groups; None: the optimizer's.
        warmup_ratio: share of all optimizer steps with a linear warmup (scheduler argument).
        dropout: before the head; None: the encoder config's ``classifier_dropout`` / ``hidden_dropout_prob``.
        freeze_encoder: train the head only (the encoder stays frozen and in eval mode).
        pooling: ``pooler`` (the encoder's pooler on [CLS]) or ``cls`` (the raw [CLS] hidden state); causal
            LMs always ``last`` (the last real token; module doc).
        layer_decay: layer-wise learning-rate factor (see the module docstring).
    """

    not_hyperparameters = ("encoder",)
    scheduler_interval = "step"  # the linear warmup/decay is defined over optimizer steps

    def __init__(self, encoder, task: str, optimizer: Callable | None = None, scheduler: Callable | None = None,
                 head_lr: float | None = None, warmup_ratio: float = 0.1, dropout: float | None = None,
                 freeze_encoder: bool = False, pooling: str = "pooler", layer_decay: float = 1.0,
                 monitor: str | None = None, mode: str = "max", scheduler_monitor: str | None = None):
        spec = task_spec(task)
        monitor = monitor or f"val/{spec.main_metric}"  # saved with the hyperparameters as resolved here
        super().__init__(optimizer, scheduler, monitor, mode, scheduler_monitor=scheduler_monitor,
                         metrics={s: dict(task_metrics(spec.name).items()) for s in SPLITS})
        self.spec = spec
        self.task = self.spec.name
        self.hf_config = copy.deepcopy(encoder.config)
        self.tokenizer = encoder.tokenizer
        self.encoder_name = getattr(encoder, "name", "")
        self.encoder = copy.deepcopy(encoder.base)  # the encoder without its head (e.g. BertModel)
        self.encoder.requires_grad_(not freeze_encoder)
        self.encoder.train(not freeze_encoder)  # Encoder.model is in eval mode; Lightning keeps submodule modes
        if not layer_decay > 0:
            raise ValueError(f"layer_decay must be > 0, got {layer_decay}")
        self.pooling = classification_pooling(encoder, pooling)
        if self.pooling == "pooler" and getattr(self.encoder, "pooler", None) is None:
            raise ValueError(f"pooling='pooler' but {type(self.encoder).__name__} has no pooler; set probe.pooling=cls "
                             f"(the raw [CLS] hidden state)")
        if dropout is None:
            dropout = getattr(self.hf_config, "classifier_dropout", None)
            dropout = dropout if dropout is not None else getattr(self.hf_config, "hidden_dropout_prob", 0.1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(self.hf_config.hidden_size, self.spec.num_labels, bias=self.pooling != "last")
        std = getattr(self.hf_config, "initializer_range", 0.02)
        nn.init.normal_(self.head.weight, std=std)
        if self.head.bias is not None:
            nn.init.zeros_(self.head.bias)
        self._encoder_layers: dict[str, int] | None = None

    @classmethod
    def saved_hparams(cls, checkpoint: dict[str, Any], path: str | Path) -> dict[str, Any]:
        """The constructor arguments a Lightning checkpoint of this module saved (``hyper_parameters``).

        Args:
            checkpoint: The loaded checkpoint.
            path: Its file (errors).

        Returns:
            The keyword arguments (all but ``encoder``).

        Raises:
            ValueError: naming the file and the key, for a key the constructor does not take (``lr``,
                ``weight_decay``, ``adam_eps``: with the config key that sets them now).
        """
        hp = dict(checkpoint.get("hyper_parameters") or {})
        known = set(inspect.signature(cls.__init__).parameters) - {"self", *cls.not_hyperparameters}
        for key in sorted(set(hp) - known):
            if key in OPTIMIZER_KEYS:
                raise ValueError(f"{path}: hyper_parameters holds {key!r}, which {cls.__name__} does not take: "
                                 f"it is {OPTIMIZER_KEYS[key]} (the optimizer partial) in training; to load these "
                                 f"weights, drop {key!r} from the checkpoint's hyper_parameters")
            raise ValueError(f"{path}: hyper_parameters holds {key!r}, which {cls.__name__} does not take "
                             f"(its arguments: {sorted(known)})")
        return hp

    # ------------------------------------------------------------------ model
    def train(self, mode: bool = True):
        super().train(mode)
        if self.hparams.freeze_encoder:
            self.encoder.eval()  # frozen baseline: no dropout inside the encoder either
        return self

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, **_) -> torch.Tensor:
        """(B, T) ids, mask and token types (dropped for families without them) -> (B, num_labels) logits."""
        out = self.encoder(**structure.model_inputs(self.encoder, input_ids=input_ids, attention_mask=attention_mask,
                                                token_type_ids=token_type_ids))
        return self.head(self.dropout(pool(out, self.pooling, attention_mask)))

    def loss(self, logits, labels):
        """Cross-entropy over the labels, MSE for the regression task (STS-B)."""
        if self.spec.num_labels == 1:
            return nn.functional.mse_loss(logits.squeeze(-1), labels.float())
        return nn.functional.cross_entropy(logits, labels)

    # ------------------------------------------------------------------ steps
    def step(self, batch: dict[str, torch.Tensor], split: str) -> tuple[torch.Tensor, int, None]:
        """The task's loss (mean over examples) and metric updates."""
        logits = self(**batch)  # (B, num_labels)
        labels = batch["labels"]  # (B,)
        loss = self.loss(logits, labels)
        getattr(self, f"{split}_metrics").update(predictions(self.task, logits.detach()), labels)
        return loss, len(labels), None

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)
        return loss

    def describe_batch(self, batch: dict[str, torch.Tensor]) -> str:
        """The batch's example indices (``idx`` of the GLUE files)."""
        return f"examples idx {batch['idx'].tolist()}"

    def on_train_start(self):
        self.encoder.train(not self.hparams.freeze_encoder)

    # ------------------------------------------------------------------ optimisation
    def encoder_layers(self) -> dict[str, int]:
        """``{encoder parameter name: layer}``: 0 embeddings, 1..L blocks, L + 1 pooler / final norm
        (:func:`probes.model.layers.parameter_layers`, found once)."""
        if self._encoder_layers is None:
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
        split further by layer, each with a ``layer`` key and an ``lr_scale`` of :meth:`layer_lr_scale` (the
        optimizer's lr times it: :meth:`probes.training.module.ProbeModule.configure_optimizers`)."""
        hp = self.hparams
        decay = float(hp.get("layer_decay", 1.0))
        parts = []
        if not hp.freeze_encoder:
            named = [(n, p) for n, p in self.encoder.named_parameters() if p.requires_grad]
            if decay == 1.0:
                parts.append((named, {}))
            else:  # configure_optimizers scales each group's lr by its lr_scale
                layers = self.encoder_layers()
                for l in sorted({layers[n] for n, _ in named}):
                    parts.append(([(n, p) for n, p in named if layers[n] == l],
                                  {"layer": l, "lr_scale": self.layer_lr_scale(l)}))
        head_named = [(n, p) for n, p in self.head.named_parameters() if p.requires_grad]
        parts.append((head_named, {"lr": hp.head_lr} if hp.head_lr is not None else {}))
        groups = []
        for params, extra in parts:
            groups.append({"params": [p for n, p in params if not n.endswith(NO_DECAY)], **extra})
            groups.append({"params": [p for n, p in params if n.endswith(NO_DECAY)], "weight_decay": 0.0, **extra})
        return [g for g in groups if g["params"]]

    def scheduler_arguments(self) -> dict[str, int]:
        """``num_warmup_steps = warmup_ratio * total`` and ``num_training_steps = total`` optimizer steps."""
        total = int(self.trainer.estimated_stepping_batches)
        return dict(num_warmup_steps=int(self.hparams.warmup_ratio * total), num_training_steps=total)
