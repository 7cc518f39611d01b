"""Extraction stage on Lightning's predict loop: batches by length, shards under DDP, atomic cache."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader, Dataset

from probes.model.load import Encoder
from probes.extract import cache as C
from probes.model.inputs import Encoded, encode_words, pool_attention, pooling_matrix

log = logging.getLogger(__name__)


def length_batches(lengths: list[int], max_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group indices sorted by length so that batch_size * longest <= max_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and ((len(cur) + 1) * lengths[i] > max_tokens or len(cur) >= max_batch_size):
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + [cur] if cur else batches


def pad_pieces(items: list[Encoded], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded wordpiece ids and attention mask, (B, T) each, T = the longest of `items`."""
    B, T = len(items), max(e.n_pieces for e in items)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    for k, e in enumerate(items):
        input_ids[k, :e.n_pieces] = torch.tensor(e.input_ids)
        mask[k, :e.n_pieces] = 1
    return input_ids, mask


class SentenceBatches(Dataset):
    """Each item is one padded batch of sentences (DataLoader with batch_size=None)."""

    def __init__(self, encoded: list[Encoded], indices: list[int], batches: list[list[int]],
                 from_pool: str, to_pool: str, pad_id: int):
        self.encoded, self.indices, self.batches = encoded, indices, batches
        self.from_pool, self.to_pool, self.pad_id = from_pool, to_pool, pad_id

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, b: int) -> dict[str, torch.Tensor]:
        items = [self.encoded[i] for i in self.batches[b]]
        input_ids, mask = pad_pieces(items, self.pad_id)  # (B, T) each
        (B, T), W = input_ids.shape, max(e.n_words for e in items) + 2
        from_mat = torch.zeros(B, W, T)  # (B, W, T)
        to_mat = torch.zeros(B, W, T)  # (B, W, T)
        for k, e in enumerate(items):
            t, w = e.n_pieces, e.n_words + 2
            from_mat[k, :w, :t] = pooling_matrix(e.word_of_piece, e.n_words, self.from_pool)
            to_mat[k, :w, :t] = pooling_matrix(e.word_of_piece, e.n_words, self.to_pool)
        index = torch.tensor([self.indices[i] for i in self.batches[b]])  # (B,) sentence index
        n_words = torch.tensor([e.n_words for e in items])  # (B,)
        return dict(input_ids=input_ids, attention_mask=mask, from_mat=from_mat, to_mat=to_mat,
                    index=index, n_words=n_words)


class _StopForward(Exception):
    pass


def self_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The per-layer self-attention modules of a BERT-family encoder (`encoder.layer[i].attention.self`)."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if layers is None or not all(hasattr(getattr(l, "attention", None), "self") for l in layers):
        return None
    return [l.attention.self for l in layers]


class AttentionExtractor(pl.LightningModule):
    """Runs the frozen encoder and pools its attention to words; predict only.

    Attention probabilities are read by forward hooks on each layer's self-attention; the forward
    stops right after the last one, so the last layer's output projection and feed-forward block
    (which no attention map depends on) are never computed.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.attn_modules = self_attention_modules(model)

    def _attentions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        if self.attn_modules is None:  # unknown layout: full forward
            return list(self.model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True).attentions)
        maps: list[torch.Tensor] = []

        def hook(module, args, output):
            maps.append(output[1])  # (B, H, T, T)
            if module is self.attn_modules[-1]:
                raise _StopForward

        handles = [m.register_forward_hook(hook) for m in self.attn_modules]
        try:
            self.model(input_ids=input_ids, attention_mask=attention_mask)
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        return maps

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        attn = torch.stack(self._attentions(batch["input_ids"], batch["attention_mask"]), dim=1)  # (B, L, H, T, T)
        B, L, H, T, _ = attn.shape
        with torch.autocast(self.device.type, enabled=False):
            words = pool_attention(attn.reshape(B, L * H, T, T).float(), batch["from_mat"], batch["to_mat"])
        return dict(maps=words.reshape(B, L, H, *words.shape[-2:]).half().cpu(),  # (B, L, H, W, W)
                    index=batch["index"].cpu(), n_words=batch["n_words"].cpu())


class CacheWriter(BasePredictionWriter):
    """Writes each rank's predictions to its own shard; rank 0 finalizes the entry."""

    def __init__(self, final_dir: Path, manifest: dict):
        super().__init__(write_interval="batch")
        self.final_dir = Path(final_dir)
        self.partial_dir = self.final_dir.with_name(self.final_dir.name + ".partial")
        self.manifest = manifest
        self.shard: C.ShardWriter | None = None

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            if self.partial_dir.exists():
                log.warning("removing incomplete cache from an interrupted run: %s", self.partial_dir)
                shutil.rmtree(self.partial_dir)
            self.partial_dir.mkdir(parents=True)
        trainer.strategy.barrier()
        self.shard = C.ShardWriter(self.partial_dir, trainer.global_rank)

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        maps = prediction["maps"].numpy()
        for k, (i, n) in enumerate(zip(prediction["index"].tolist(), prediction["n_words"].tolist())):
            self.shard.write(i, maps[k, :, :, : n + 2, : n + 2])

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.shard.close()
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            C.finalize(self.partial_dir, self.final_dir, self.manifest)
        trainer.strategy.barrier()


def resolve_precision(precision: str, accelerator: str) -> str:
    """`auto`: fp16 autocast on a GPU, bf16 autocast on a CPU with native bf16, else full fp32."""
    if precision != "auto":
        return precision
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "16-mixed"
    return "bf16-mixed" if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX") and \
        torch.cpu._is_avx512_bf16_supported() else "32-true"


def extract(
    encoder: Encoder,
    sentences: list[list[str]],
    key: dict,
    cache_dir: str | Path,
    trainer: Callable[..., pl.Trainer],
    from_words: str = "mean",
    to_words: str = "sum",
    max_length: int | None = None,
    long_sentences: str = "skip",
    max_tokens: int = 4096,
    max_batch_size: int = 128,
    num_workers: int = 0,
) -> C.AttentionCache:
    """Write (or reuse) the cache entry for `key`; `trainer` is a partial Trainer constructor."""
    final_dir = C.entry_dir(cache_dir, key)
    if (final_dir / "manifest.json").exists():
        log.info("attention cache hit: %s", final_dir)
        return C.AttentionCache(final_dir)
    max_length = max_length or encoder.max_length
    encoded = encode_words(encoder.tokenizer, sentences)
    too_long = [i for i, e in enumerate(encoded) if e.n_pieces > max_length]
    if too_long and long_sentences == "error":
        raise ValueError(f"{len(too_long)} sentences exceed {max_length} wordpieces (first: #{too_long[0]}); "
                         "set extract.long_sentences=skip to leave them out")
    if long_sentences not in ("skip", "error"):
        raise ValueError(f"extract.long_sentences must be 'skip' or 'error', got '{long_sentences}'")
    if too_long:
        log.warning("%d of %d sentences exceed %d wordpieces and are left out of the cache (policy: skip)",
                    len(too_long), len(sentences), max_length)
    skipped = set(too_long)
    keep = [i for i in range(len(encoded)) if i not in skipped]
    kept = [encoded[i] for i in keep]
    batches = length_batches([e.n_pieces for e in kept], max_tokens, max_batch_size)
    data = SentenceBatches(kept, keep, batches, from_words, to_words, encoder.tokenizer.pad_token_id)
    manifest = dict(format_version=C.FORMAT_VERSION, key=key, n_sentences=len(sentences), skipped=too_long,
                    num_layers=encoder.num_layers, num_heads=encoder.num_heads,
                    n_pieces=int(sum(e.n_pieces for e in kept)), dtype="float16",
                    layout="(L, H, W, W), W = words + 2: [CLS], words, [SEP]; rows attend to columns")
    writer = CacheWriter(final_dir, manifest)
    t = trainer(callbacks=[writer])
    loader = DataLoader(data, batch_size=None, num_workers=num_workers)
    log.info("extracting attention: %d sentences, %d batches -> %s", len(kept), len(batches), final_dir)
    t.predict(AttentionExtractor(encoder.model), loader, return_predictions=False)
    return C.AttentionCache(final_dir)
