"""Helpers shared by the Kovaleva et al. (2019) analyses: which fine-tuned model (``checkpoint``) goes
with which GLUE task, loading it with :func:`probes.glue.export.load_finetuned`, and the pre-trained /
fine-tuned model variants whose attention is compared.

``checkpoint`` is, everywhere, a GLUE run folder (holding ``hf_model/``), an ``hf_model`` folder, a
Lightning ``.ckpt`` (rebuilt on ``ctx.encoder``'s architecture), or a ``{task: path}`` mapping.
"""

from __future__ import annotations

from collections.abc import Mapping

from probes.data.glue import GlueExample, read_glue, task_spec
from probes.glue.evaluate import make_batches
from probes.glue.export import FineTuned, load_finetuned

PRETRAINED, FINETUNED = "pre-trained", "fine-tuned"


def checkpoints(checkpoint, task: str | None = None) -> dict[str | None, str]:
    """``{task: path}`` of a required ``checkpoint`` (one path -> ``{task: path}``)."""
    if checkpoint is None:
        raise ValueError("set analysis.checkpoint=<run dir | hf_model dir | .ckpt> (or a {task: path} mapping)")
    if isinstance(checkpoint, Mapping) or hasattr(checkpoint, "items"):
        return {str(k): str(v) for k, v in checkpoint.items()}
    return {task: str(checkpoint)}


def checkpoint_for(checkpoint, task: str) -> str | None:
    """The optional ``checkpoint`` of one task: None, one path (any task) or the task's mapping entry."""
    if not checkpoint:
        return None
    if isinstance(checkpoint, Mapping) or hasattr(checkpoint, "items"):
        name = task_spec(task).name
        for k, v in checkpoint.items():
            if task_spec(str(k)).name == name:
                return str(v)
        return None
    return str(checkpoint)


def load_checkpoint(ctx, path: str, task: str | None = None, compare: bool = False,
                    require_task: bool = False) -> FineTuned:
    """The fine-tuned model at ``path`` (``ctx.encoder`` rebuilds a ``.ckpt``); ``task`` (if given)
    must be the one it was tuned on; ``compare``: its vocabulary must equal ``ctx.encoder``'s, so its
    maps line up with the pre-trained ones. The result's ``task`` is the task's canonical name or None;
    ``require_task``: an error when neither ``task`` nor the checkpoint says which task it is."""
    needs_encoder = compare or str(path).endswith(".ckpt")
    enc = ctx.encoder if needs_encoder else None
    ft = load_finetuned(path, encoder=enc, task=task, reference_tokenizer=enc.tokenizer if compare else None)
    ft.task = task_spec(ft.task).name if ft.task is not None else None
    if require_task and ft.task is None:
        raise ValueError(f"{path}: task unknown (no glue_task.json / finetuning_task); set analysis.task")
    return ft


def glue_batches(ctx, ft: FineTuned, split: str, max_examples: int | None, max_length: int,
                 batch_size: int) -> tuple[list[GlueExample], list[dict]]:
    """(examples, batches): the first ``max_examples`` examples of the GLUE ``split`` of ``ft.task`` (read from
    ``ctx.data_dir``) and their padded batches for ``ft``'s tokenizer (:func:`probes.glue.evaluate.make_batches`)."""
    examples = read_glue(ft.task, split, ctx.data_dir)[:max_examples]
    return examples, make_batches(ft.tokenizer, examples, ft.task, max_length, batch_size)


def variants(ctx, checkpoint: str | None, task: str | None = None) -> dict[str, tuple[object, object]]:
    """``{"pre-trained": (model, tokenizer)[, "fine-tuned": (model, tokenizer)]}``: ``ctx.encoder`` and,
    when ``checkpoint`` is a path, the fine-tuned model (same vocabulary required)."""
    out = {PRETRAINED: (ctx.encoder.model, ctx.encoder.tokenizer)}
    if checkpoint:
        ft = load_checkpoint(ctx, checkpoint, task, compare=True)
        out[FINETUNED] = (ft.model, ft.tokenizer)
    return out
