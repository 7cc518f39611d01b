"""The fine-tuned GLUE model on disk: written at the end of fine-tuning, read by every analysis of it.

Written by :func:`export_hf` (``probes.glue.callbacks.HFExport``, ``<run dir>/hf_model``): a Hugging Face
folder (``save_pretrained``: config, weights, tokenizer) plus ``glue_task.json`` (:data:`EXPORT_INFO`: task,
number of labels, main metric, pooling, encoder, frozen or not, layer decay). Architectures whose
classification head is pooler -> dropout -> ``classifier`` Linear (BERT family) and causal LMs (last real
token -> ``score`` Linear without bias: Llama, Qwen, GPT-2, ...; pooling ``last``) are saved as a
``*ForSequenceClassification``; any other family as its bare encoder plus ``head.pt`` (the head's weights),
read back as an :class:`EncoderWithHead` with the same logits as the trained module.

Read by :func:`load_finetuned`: a GLUE run folder, its ``hf_model`` folder, or a Lightning ``.ckpt``
(rebuilt on the pre-trained encoder's architecture), as a :class:`FineTuned` model on the project's
attention path, frozen, in eval mode. A ``.ckpt`` and ``head.pt`` are loaded weights-only: a file holding more
than tensors and plain values is refused (:class:`probes.training.checkpoint.UnsafeCheckpointError`, naming it).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutput

from probes.data.glue import task_spec
from probes.glue.module import SequenceClassifier, pool
from probes.model.attention_function import IMPLEMENTATION, register
from probes.model.families import is_causal
from probes.model.load import WEIGHTS_DTYPE, Encoder, freeze, load_tokenizer
from probes.model.structure import model_inputs
from probes.training.checkpoint import load_checkpoint

log = logging.getLogger(__name__)

EXPORT_INFO = "glue_task.json"  # beside the weights: what the model was fine-tuned on and how it pools


# ----------------------------------------------------------------------------- writing
# pooling -> the *ForSequenceClassification attribute holding the head's Linear
HF_HEADS = {"pooler": "classifier", "last": "score"}


def to_hf(module: SequenceClassifier, state_dict: dict | None = None) -> torch.nn.Module:
    """A `*ForSequenceClassification` model (eager attention) with ``module``'s encoder and head.

    `state_dict`: a Lightning checkpoint's `state_dict` (e.g. the best epoch) instead of the module's
    current weights. Requires `pooling='pooler'` and an architecture whose classification head is
    pooler -> dropout -> `classifier` Linear (BERT-family), or `pooling='last'` (causal LMs: transformers
    pools the rightmost token that is not the pad token, the module the last one its attention mask keeps:
    the same token for right-padded rows not ending in the pad token); raises ValueError otherwise.
    """
    pooling = module.pooling
    if pooling not in HF_HEADS:
        raise ValueError(f"to_hf needs pooling in {sorted(HF_HEADS)}, got {pooling!r} (BertForSequenceClassification "
                         "uses the pooler, a decoder's the last token)")
    cfg = copy.deepcopy(module.hf_config)
    cfg.num_labels = module.spec.num_labels
    cfg.problem_type = "regression" if module.spec.num_labels == 1 else "single_label_classification"
    cfg.finetuning_task = module.task
    cfg.classifier_dropout = module.dropout.p
    cfg.architectures = None
    if pooling == "last" and getattr(cfg, "pad_token_id", None) is None:
        raise ValueError("a decoder's *ForSequenceClassification finds the last token by config.pad_token_id, "
                         "which is not set")
    model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager", dtype=WEIGHTS_DTYPE)
    base = model.base_model
    clf = getattr(model, HF_HEADS[pooling], None)
    if not isinstance(clf, torch.nn.Linear) or clf.weight.shape != module.head.weight.shape \
            or (clf.bias is None) != (module.head.bias is None):
        raise ValueError(f"{type(model).__name__} has no compatible `{HF_HEADS[pooling]}` Linear")
    if state_dict is None:
        enc_sd, head_sd = module.encoder.state_dict(), module.head.state_dict()
    else:
        enc_sd = {k[len("encoder."):]: v for k, v in state_dict.items() if k.startswith("encoder.")}
        head_sd = {k[len("head."):]: v for k, v in state_dict.items() if k.startswith("head.")}
    base.load_state_dict(enc_sd, strict=True)
    clf.load_state_dict(head_sd, strict=True)
    model.config.architectures = [type(model).__name__]
    return model.eval()


def export_hf(module: SequenceClassifier, dirpath: str | Path, state_dict: dict | None = None) -> Path:
    """Save ``module`` (or ``state_dict``'s weights) + tokenizer with `save_pretrained`, and
    :data:`EXPORT_INFO`; returns the folder."""
    d = Path(dirpath)
    d.mkdir(parents=True, exist_ok=True)
    try:
        model = to_hf(module, state_dict)
        model.save_pretrained(d)
    except ValueError as e:  # incompatible head: save the encoder and the head weights separately
        log.warning("saving encoder + head.pt, not a *ForSequenceClassification model: %s", e)
        sd = state_dict or module.state_dict()
        enc = copy.deepcopy(module.encoder)
        enc.load_state_dict({k[8:]: v for k, v in sd.items() if k.startswith("encoder.")})
        enc.save_pretrained(d)
        torch.save({k[5:]: v for k, v in sd.items() if k.startswith("head.")}, d / "head.pt")
    module.tokenizer.save_pretrained(d)
    hp = module.hparams
    info = dict(task=module.task, num_labels=module.spec.num_labels, main_metric=module.spec.main_metric,
                pooling=module.pooling, encoder=module.encoder_name, freeze_encoder=bool(hp.freeze_encoder),
                layer_decay=float(hp.layer_decay))
    (d / EXPORT_INFO).write_text(json.dumps(info, indent=1))
    log.info("saved Hugging Face model to %s", d)
    return d


# ----------------------------------------------------------------------------- reading
@dataclass
class FineTuned:
    """A fine-tuned sequence classifier (eval mode, project attention path) and what it was tuned on."""

    model: torch.nn.Module      # *ForSequenceClassification, or EncoderWithHead
    tokenizer: object
    task: str | None
    path: str

    @property
    def base(self) -> torch.nn.Module:
        """The fine-tuned encoder without its head."""
        return self.model.base_model


def hf_folder(path: str | Path) -> Path | None:
    """``path`` itself if it is a Hugging Face model folder, ``path/hf_model`` for a GLUE run folder, else None."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return p
    if p.is_dir() and (p / "hf_model" / "config.json").exists():
        return p / "hf_model"
    return None


def export_info(folder: Path) -> dict:
    """The :data:`EXPORT_INFO` of an export folder ({} for a folder written by other tools)."""
    return json.loads((folder / EXPORT_INFO).read_text()) if (folder / EXPORT_INFO).exists() else {}


def load_finetuned(checkpoint: str | Path, encoder: Encoder | None = None, task: str | None = None,
                   reference_tokenizer=None) -> FineTuned:
    """A fine-tuned model from a GLUE run folder, its ``hf_model`` folder, or a Lightning ``.ckpt``
    (rebuilt on ``encoder``'s architecture). ``task`` checks the saved task; ``reference_tokenizer``
    (e.g. the pre-trained encoder's) must have the same vocabulary, so the maps are comparable."""
    p = Path(checkpoint).expanduser()
    folder = hf_folder(p)
    if folder is not None:
        saved_task = export_info(folder).get("task") or getattr(AutoConfig.from_pretrained(str(folder)),
                                                                "finetuning_task", None)
        model, tokenizer = _load_classifier(folder)
        path = str(folder)
    elif p.is_file() and p.suffix == ".ckpt":
        if encoder is None:
            raise ValueError(f"{p}: a Lightning checkpoint needs the encoder it was trained from")
        ckpt = load_checkpoint(p, map_location="cpu", mmap=False)
        hp = SequenceClassifier.saved_hparams(ckpt, p)
        saved_task = hp.get("task")
        module = SequenceClassifier(encoder, **hp)
        module.load_state_dict(ckpt["state_dict"])
        model, tokenizer, path = to_hf(module), encoder.tokenizer, str(p)
    else:
        raise FileNotFoundError(f"fine-tuned model not found: {p} is neither a Hugging Face folder (config.json), "
                                f"a GLUE run folder holding hf_model/, nor a Lightning .ckpt file")
    if task is not None and saved_task is not None:
        if task_spec(task).name != task_spec(saved_task).name:
            raise ValueError(f"{p} was fine-tuned on {saved_task}, not {task}")
    if reference_tokenizer is not None and tokenizer.get_vocab() != reference_tokenizer.get_vocab():
        raise ValueError(f"{p}: tokenizer vocabulary differs from the encoder's; the maps would not be comparable")
    freeze(model)
    return FineTuned(model, tokenizer, task or saved_task, path)


class EncoderWithHead(torch.nn.Module):
    """A fine-tuned encoder saved as a bare encoder plus ``head.pt`` (families whose transformers
    classification head differs from pooler -> dropout -> Linear): same logits as the trained module."""

    def __init__(self, encoder: torch.nn.Module, head: torch.nn.Linear, pooling: str):
        super().__init__()
        if pooling not in ("pooler", "cls", "last"):
            raise ValueError(f"pooling must be 'pooler', 'cls' or 'last', got {pooling!r}")
        self.encoder, self.head, self.pooling = encoder, head, pooling
        self.config = encoder.config

    @property
    def base_model(self) -> torch.nn.Module:
        """The encoder without the head (as ``*ForSequenceClassification.base_model``)."""
        return self.encoder

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None):
        """(B, T) inputs -> output with ``.logits`` (B, num_labels)."""
        out = self.encoder(**model_inputs(self.encoder, input_ids=input_ids, attention_mask=attention_mask,
                                                token_type_ids=token_type_ids, inputs_embeds=inputs_embeds))
        pooled = pool(out, self.pooling, attention_mask)  # (B, D)
        return SequenceClassifierOutput(logits=self.head(pooled))


def _load_classifier(folder: Path):
    """(model, tokenizer) of a saved folder: a *ForSequenceClassification, or an encoder + ``head.pt``."""
    register()
    cfg = AutoConfig.from_pretrained(str(folder))
    archs = cfg.architectures or []
    if any("SequenceClassification" in a for a in archs):
        model = AutoModelForSequenceClassification.from_pretrained(str(folder), attn_implementation=IMPLEMENTATION,
                                                                   dtype=WEIGHTS_DTYPE)
    elif (folder / "head.pt").exists():
        state = load_checkpoint(folder / "head.pt", map_location="cpu", mmap=False)
        head = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
        head.load_state_dict(state)
        encoder = AutoModel.from_pretrained(str(folder), attn_implementation=IMPLEMENTATION, dtype=WEIGHTS_DTYPE)
        model = EncoderWithHead(encoder, head, export_info(folder).get("pooling", "cls"))
    else:
        model = AutoModel.from_pretrained(str(folder), attn_implementation=IMPLEMENTATION, dtype=WEIGHTS_DTYPE)
    return model, load_tokenizer(str(folder), causal=is_causal(cfg))
