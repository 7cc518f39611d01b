"""Live wordpiece attention for GLUE inputs and treebank sentences, pre-trained or fine-tuned encoder.

GLUE examples are tokenized with the model's own tokenizer exactly as the labelled maps were made:
``[CLS] a [SEP]`` for single sentences, ``[CLS] a [SEP] b [SEP]`` for pairs (with token type ids),
no truncation (examples outside ``[min_length, max_length]`` wordpieces are skipped and counted).
Batches group examples by length; padded keys get zero attention from a padded batch (attention
mask), so cropping each map to its own length equals running the example alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from probes.extract.stage import length_batches

log = logging.getLogger(__name__)


@dataclass
class Item:
    index: int                          # example / sentence index in the input list
    input_ids: list[int]                # (T,) with [CLS]/[SEP]
    token_type_ids: list[int] | None = None
    word_of_piece: list[int] | None = None   # (T,) -1 for special tokens, else a word index
    words: list[dict] = field(default_factory=list)  # per word: text, upos, deprel (linguistic analysis)

    @property
    def n(self) -> int:
        return len(self.input_ids)


def encode_glue(tokenizer, examples, min_length: int = 0, max_length: int | None = None) -> tuple[list[Item], int]:
    """Items of GLUE examples (``.text_a``, ``.text_b``) within the length range; and the number skipped."""
    items, skipped = [], 0
    for i, e in enumerate(examples):
        enc = tokenizer(e.text_a, e.text_b) if e.text_b is not None else tokenizer(e.text_a)
        ids = list(enc["input_ids"])
        if len(ids) < min_length or (max_length is not None and len(ids) > max_length):
            skipped += 1
            continue
        tt = list(enc["token_type_ids"]) if "token_type_ids" in enc else None
        items.append(Item(i, ids, tt))
    return items, skipped


def resolve_hf_folder(path: str | Path) -> Path:
    """A Hugging Face model folder: ``path`` itself, or ``path/hf_model`` (a GLUE fine-tuning run folder)."""
    p = Path(path).expanduser()
    if p.is_dir() and not (p / "config.json").exists() and (p / "hf_model" / "config.json").exists():
        p = p / "hf_model"
    if not (p.is_dir() and (p / "config.json").exists()):
        raise FileNotFoundError(f"fine-tuned model: {p} is not a Hugging Face model folder (no config.json); "
                                f"give <GLUE run>/hf_model or a folder saved with save_pretrained")
    return p


def load_hf_base(path: str | Path, reference_tokenizer=None):
    """(base model, tokenizer) of a saved HF folder via ``AutoModel`` (a *ForSequenceClassification
    checkpoint loads its encoder), eval mode, eager attention. The tokenizer must match the reference."""
    from transformers import AutoModel, AutoTokenizer

    p = resolve_hf_folder(path)
    model = AutoModel.from_pretrained(str(p), attn_implementation="eager")
    model.eval()
    model.requires_grad_(False)
    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError):
        if reference_tokenizer is None:
            raise
        tok = reference_tokenizer
    if reference_tokenizer is not None and tok.get_vocab() != reference_tokenizer.get_vocab():
        raise ValueError(f"{p}: tokenizer vocabulary differs from the encoder's; the maps would not be comparable")
    return model, tok


@torch.inference_mode()
def iter_attention(model, items: Sequence[Item], device: str = "cpu", max_tokens: int = 4096,
                   max_batch_size: int = 64, pad_id: int = 0, desc: str = "attention",
                   progress: bool = True) -> Iterator[tuple[Item, np.ndarray]]:
    """Yield ``(item, (L, H, T, T) float32 attention)``, in length-batch order."""
    model = model.to(device)
    batches = length_batches([it.n for it in items], max_tokens, max_batch_size)
    with tqdm(total=len(items), desc=desc, unit="ex", disable=None if progress else True) as bar:
        for batch in batches:
            its = [items[b] for b in batch]
            B, T = len(its), max(it.n for it in its)
            ids = torch.full((B, T), pad_id, dtype=torch.long)
            mask = torch.zeros(B, T, dtype=torch.long)
            tt = torch.zeros(B, T, dtype=torch.long)
            for k, it in enumerate(its):
                ids[k, :it.n] = torch.tensor(it.input_ids)
                mask[k, :it.n] = 1
                if it.token_type_ids is not None:
                    tt[k, :it.n] = torch.tensor(it.token_type_ids)
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), token_type_ids=tt.to(device),
                        output_attentions=True)
            attn = torch.stack(list(out.attentions), dim=1).float().cpu().numpy()  # (B, L, H, T, T)
            for k, it in enumerate(its):
                yield it, attn[k, :, :, :it.n, :it.n]
            bar.update(B)


def model_variants(ctx, finetuned) -> dict[str, tuple[torch.nn.Module, object]]:
    """{"pre-trained": (model, tokenizer)[, "fine-tuned": ...]} for one task (finetuned: path or None)."""
    out = {"pre-trained": (ctx.encoder.model, ctx.encoder.tokenizer)}
    if finetuned:
        out["fine-tuned"] = load_hf_base(finetuned, ctx.encoder.tokenizer)
    return out


def finetuned_for(finetuned, task: str) -> str | None:
    """``finetuned`` may be None, one path (one task) or a {task: path} mapping."""
    if not finetuned:
        return None
    if hasattr(finetuned, "items"):
        return str(finetuned[task]) if task in finetuned else None
    return str(finetuned)
