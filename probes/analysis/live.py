"""Wordpiece-level attention from the live encoder: each sentence alone as ``[CLS] s [SEP]``.

Sentences are tokenized from their treebank words (as the cache does), batched by length
(padding keys get zero attention, so cropping a padded map to the sentence's T is exact),
run under ``torch.inference_mode`` with ``output_attentions=True`` on the GPU when there is one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from probes.extract.stage import length_batches, pad_pieces
from probes.model.inputs import encode_words

log = logging.getLogger(__name__)


@dataclass
class PieceAttention:
    index: int  # sentence index in the input list
    tokens: list[str]  # (T,) wordpieces incl. [CLS] and [SEP]
    attn: torch.Tensor  # (L, H, T, T) float32 on `device`


def iter_wordpiece_attention(encoder, sentences: Sequence[Sequence[str]], device: str = "cpu",
                             max_tokens: int = 4096, max_batch_size: int = 64, max_length: int | None = None,
                             desc: str = "attention") -> Iterator[PieceAttention]:
    """Yield the wordpiece attention of every sentence (words) that fits the encoder.

    Sentences longer than ``max_length`` wordpieces (default: the encoder's maximum) are skipped
    and logged. Order of the yielded sentences follows length batches, not the input order.
    """
    max_length = max_length or encoder.max_length
    encoded = encode_words(encoder.tokenizer, [list(w) for w in sentences])
    keep = [i for i, e in enumerate(encoded) if e.n_pieces <= max_length]
    if len(keep) < len(encoded):
        log.warning("%d of %d sentences exceed %d wordpieces and are skipped",
                    len(encoded) - len(keep), len(encoded), max_length)
    batches = length_batches([encoded[i].n_pieces for i in keep], max_tokens, max_batch_size)
    model = encoder.model.to(device)
    pad = encoder.tokenizer.pad_token_id or 0
    with torch.inference_mode(), tqdm(total=len(keep), desc=desc, unit="sent", disable=None) as bar:
        for batch in batches:
            items = [encoded[keep[b]] for b in batch]
            ids, mask = pad_pieces(items, pad)  # (B, T) each
            B = len(items)
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_attentions=True)
            attn = torch.stack(list(out.attentions), dim=1).float()  # (B, L, H, T, T)
            for k, e in enumerate(items):
                t = e.n_pieces
                yield PieceAttention(keep[batch[k]], encoder.tokenizer.convert_ids_to_tokens(e.input_ids),
                                     attn[k, :, :, :t, :t])
            bar.update(B)
