"""Load a fine-tuned GLUE model for analysis: a Hugging Face folder (`<run>/hf_model`) or a
Lightning checkpoint (`<run>/checkpoints/best-*.ckpt`, rebuilt on the given encoder's architecture)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from probes.data.glue import task_spec
from probes.glue.module import EXPORT_INFO, SequenceClassifier


@dataclass
class FineTuned:
    model: torch.nn.Module      # *ForSequenceClassification, eval mode, eager attention
    tokenizer: object
    task: str
    path: str

    @property
    def base(self) -> torch.nn.Module:
        return getattr(self.model, self.model.base_model_prefix)


def load_finetuned(checkpoint: str | Path, encoder=None, task: str | None = None) -> FineTuned:
    """`checkpoint`: an `hf_model` folder, a run folder holding one, or a `.ckpt` (needs `encoder`)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    p = Path(checkpoint).expanduser()
    if p.is_dir() and not (p / "config.json").exists() and (p / "hf_model" / "config.json").exists():
        p = p / "hf_model"
    if p.is_dir():
        info = json.loads((p / EXPORT_INFO).read_text()) if (p / EXPORT_INFO).exists() else {}
        saved_task = info.get("task") or getattr(_config(p), "finetuning_task", None)
        model = AutoModelForSequenceClassification.from_pretrained(str(p), attn_implementation="eager")
        tokenizer = AutoTokenizer.from_pretrained(str(p))
    elif p.is_file():
        ckpt = torch.load(p, map_location="cpu", weights_only=False)
        hp = dict(ckpt.get("hyper_parameters") or {})
        if encoder is None:
            raise ValueError(f"{p}: a Lightning checkpoint needs the encoder it was trained from")
        saved_task = hp.get("task")
        module = SequenceClassifier(encoder, **hp)
        module.load_state_dict(ckpt["state_dict"])
        model, tokenizer = module.to_hf(), encoder.tokenizer
    else:
        raise FileNotFoundError(f"fine-tuned checkpoint not found: {p}")
    if task is not None and saved_task is not None and task_spec(task).name != task_spec(saved_task).name:
        raise ValueError(f"{p} was fine-tuned on {saved_task}, not {task}")
    task = task or saved_task
    if task is None:
        raise ValueError(f"{p}: task unknown; pass analysis.task")
    model.eval()
    model.requires_grad_(False)
    return FineTuned(model, tokenizer, task_spec(task).name, str(p))


def _config(p: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(p))
