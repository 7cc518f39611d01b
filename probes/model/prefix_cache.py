"""Reuse of the block outputs below the first changed layer, from a plain run of the same inputs."""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from probes.model.structure import blocks, model_inputs


class PrefixCache:
    """Reuse the outputs of the blocks below the first changed layer (they cannot change).

    ``outs = PrefixCache.record(model, inputs)`` runs the plain model once and returns ``(result,
    outputs)``, the outputs of the embeddings and of every block; inside ``with PrefixCache.reuse(model,
    outputs, first_layer)`` the embeddings and blocks ``< first_layer`` return those stored outputs
    without computing, and the rest of the model runs as usual. Used by head disabling to score a
    change in layer l in about (L - l) / L of a forward. Not for shared-weight blocks (ALBERT).
    """

    @staticmethod
    def parts(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
        """(the embeddings module, the L blocks); ValueError when blocks are shared or there is no embeddings."""
        mods = blocks(model)
        if len(mods) != int(model.config.num_hidden_layers):
            raise ValueError(f"{type(model).__name__}: blocks are shared across layers; prefix reuse needs one per layer")
        emb = getattr(model.base_model, "embeddings", None)
        if emb is None:
            raise ValueError(f"{type(model).__name__}: no embeddings module")
        return emb, mods

    @classmethod
    def supported(cls, model: nn.Module) -> bool:
        """Whether :meth:`reuse` works for ``model`` (one block per layer and an embeddings module)."""
        try:
            cls.parts(model)
            return True
        except ValueError:
            return False

    @classmethod
    def record(cls, model: nn.Module, inputs: dict) -> tuple[object, list]:
        """One plain forward on ``inputs``; returns (the model's output, [embeddings output, output of block 0,
        ..., of block L - 1]) with each output as its module returned it (a (B, T, D) tensor or a tuple)."""
        emb, mods = cls.parts(model)
        outs, handles = [None] * (len(mods) + 1), []

        def keep(j):
            def hook(module, args, output):
                outs[j] = output
            return hook

        handles.append(emb.register_forward_hook(keep(0)))
        handles += [m.register_forward_hook(keep(j + 1)) for j, m in enumerate(mods)]
        try:
            result = model(**model_inputs(model, **inputs))
        finally:
            for h in handles:
                h.remove()
        return result, outs

    @classmethod
    @contextmanager
    def reuse(cls, model: nn.Module, outs: list, first_layer: int):
        """Within the block, the embeddings and blocks ``< first_layer`` return ``outs`` (from :meth:`record` of
        the same inputs) without computing; each module is as it was on exit, also when the block raises.

        The modules stay in place (the model's forward reads attributes of its blocks, e.g. ModernBERT's
        ``attention_type``) and each answers with its stored output through a :class:`_Stored` forward, set on the
        instance: the one way to skip a module's computation, since PyTorch's forward hooks and pre-hooks run
        around it and cannot skip it.
        """
        emb, mods = cls.parts(model)
        if not 0 <= first_layer <= len(mods):
            raise ValueError(f"first_layer must be in 0..{len(mods)}, got {first_layer}")
        if len(outs) != len(mods) + 1:
            raise ValueError(f"outs must hold the embeddings output and {len(mods)} block outputs "
                             f"(PrefixCache.record), got {len(outs)}")
        stored = list(zip([emb] + mods[:first_layer], outs))
        if any(isinstance(m.__dict__.get("forward"), _Stored) for m, _ in stored):
            raise RuntimeError("PrefixCache.reuse is already active on this model")
        before = [m.__dict__.get("forward") for m, _ in stored]  # an instance forward set by others (accelerate)
        try:
            for m, out in stored:
                m.forward = _Stored(out)
            yield
        finally:
            for (m, _), old in zip(stored, before):
                if old is None:
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = old


class _Stored:
    """A module's forward that ignores its arguments and returns the output stored at construction."""

    def __init__(self, output):
        self.output = output

    def __call__(self, *args, **kwargs):
        return self.output
