"""Slow, independent references the tests check the project's code against.

Encodings and word maps (:func:`text_pieces`, :func:`word_groups`, :func:`pool_by_loops`, :func:`eager_word_maps`,
:func:`plain_entry`: what a cache entry should hold) are built from the raw text alone: the model's own tokenizer on the
words joined by single spaces (``tokenizer(" ".join(words), return_offsets_mapping=True)``), each piece given to the
word whose characters it covers by a plain loop over characters, a plain ``attn_implementation="eager"`` forward with
``output_attentions=True``, and pooling by explicit loops over pieces; nothing from :mod:`probes.model.inputs` or the
capture layer. The gradient-flow references are written without the block functions, ``torch.func`` or early stops: one
plain forward and one ``autograd.grad`` per output, or the full model's head outputs from forward hooks. A ``.gguf``
file is read by transformers' own GGUF reader (:func:`gguf_reader`). Clark et al.'s head statistics
(:func:`head_stats_by_loops`) are explicit loops over the rows and keys of one sequence's eager map
(:func:`eager_maps`), its inputs the tokenizer's own on the raw sentence or pair (:func:`reference_inputs`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from probes.measures import gradflow
from probes.model import hooks, structure


def gradient_flow_loop(model: torch.nn.Module, input_ids: torch.Tensor, chain: bool = False) -> torch.Tensor:
    """Reference G (or G* when ``chain``) at piece level with one ``autograd.grad`` per output token.

    Westera's loop, independent of the block functions and of vjp/vmap: one plain forward
    ``model(inputs_embeds=..., output_hidden_states=True)``, then for every layer and output token
    ``t2`` the gradient of ``sum_d h_n(t2)`` w.r.t. the intermediate tensor ``h_{n-1}`` (``h_0`` when
    ``chain``), 2-norm over the hidden units. Returns (L, T, T) [t2, t1]. Needs ``hidden_states[n]`` to
    be block ``n - 1``'s output (BERT, DistilBERT, ALBERT, DeBERTa-v2: tested; not ModernBERT's last
    entry, which is after the final norm).
    """
    with torch.enable_grad():
        x = model.get_input_embeddings()(input_ids.unsqueeze(0)).detach().requires_grad_(True)  # (1, T, E)
        inputs = structure.model_inputs(model, inputs_embeds=x, attention_mask=torch.ones_like(input_ids)[None],
                                    output_hidden_states=True)
        hs = model(**inputs).hidden_states  # L + 1 x (1, T, D), one graph
        res = []
        for n in range(1, len(hs)):
            src, y = (hs[0] if chain else hs[n - 1]), hs[n]
            rows = []
            for t2 in range(y.shape[1]):
                (g,) = torch.autograd.grad(y[0, t2].sum(), src, retain_graph=True)
                rows.append(torch.linalg.vector_norm(g[0], dim=-1))  # (T,)
            res.append(torch.stack(rows))  # (T, T)
    return torch.stack(res).detach()  # (L, T, T)


def head_scalars_fn(model: torch.nn.Module, input_ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x (T, D) word embeddings -> s (L, H, T)``, ``s[l, h, i] = sum_k o_{l,h,i}[k]`` (the full model,
    all layers captured, no early stop; the head outputs of :mod:`probes.measures.gradflow`)."""
    mask = torch.ones_like(input_ids).unsqueeze(0)  # (1, T)

    def f(x: torch.Tensor) -> torch.Tensor:
        with hooks.attention(model, values=True) as s:
            s.run(inputs_embeds=x.unsqueeze(0), attention_mask=mask)
            out = torch.stack([s.output[l][0] for l in s.capture])  # (L, T, H, d)
        return out.sum(-1).transpose(1, 2)  # (L, H, T): sum over each head's d units

    return f


@functools.lru_cache(maxsize=1)
def gguf_reader(path: str) -> tuple[torch.nn.Module, object]:
    """(model with its LM head, tokenizer) of the ``.gguf`` file ``path`` as transformers' own GGUF reader reads it
    (``from_pretrained(folder, gguf_file=...)``, eager attention, float32; nothing of :mod:`probes`). Read once per
    process (the reader dequantizes for tens of seconds) and shared: callers only run it. The tests that read the
    fetched SmolLM2 this way are marked ``xdist_group("smollm2_gguf")``, so that one pytest-xdist worker runs them."""
    folder, file = str(Path(path).parent), Path(path).name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=file)


def text_pieces(tokenizer, words: list[str], bos: bool = False) -> tuple[list[int], list[int | None]]:
    """(ids, word of every piece or None for a special token) of the words as running text: the tokenizer on
    ``" ".join(words)`` with its specials; a piece belongs to the word whose non-space characters it covers (the
    first such word), a piece of spaces alone to the next word. ``bos``: a BOS put in front where the tokenizer
    adds none."""
    text = " ".join(words)
    owner = []  # owner[c]: the word of character c of the text, None for the spaces
    for k, w in enumerate(words):
        owner += [k] * len(w) + [None]
    enc = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    ids, special = list(enc["input_ids"]), enc["special_tokens_mask"]
    wids = []
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        if special[t]:
            wids.append(None)
            continue
        hit = [owner[c] for c in range(a, b) if owner[c] is not None]
        if not hit:
            hit = [next(owner[c] for c in range(b, len(text)) if owner[c] is not None)]
        wids.append(hit[0])
    if bos and ids[0] != tokenizer.bos_token_id:
        ids, wids = [tokenizer.bos_token_id, *ids], [None, *wids]
    return ids, wids


def word_groups(wids: list[int | None], n_words: int) -> list[list[int]]:
    """Row groups of a sequence: the specials before the first word (when any), each word's pieces, the specials
    after the last word (when any)."""
    first = [t for t, w in enumerate(wids) if w is None and not any(v is not None for v in wids[:t])]
    last = [t for t, w in enumerate(wids) if w is None and t not in first]
    groups = [first] if first else []
    groups += [[t for t, w in enumerate(wids) if w == k] for k in range(n_words)]
    return groups + ([last] if last else [])


def pool_by_loops(att: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """(..., R, R) word maps of piece maps ``att`` (..., T, T) by explicit loops: rows the mean over the row
    group's pieces, columns the sum over the column group's pieces (Clark et al.)."""
    out = np.zeros(att.shape[:-2] + (len(groups), len(groups)))
    for r, rows in enumerate(groups):
        for c, cols in enumerate(groups):
            total = 0.0
            for i in rows:
                for j in cols:
                    total = total + att[..., i, j].astype(np.float64)
            out[..., r, c] = total / len(rows)
    return out


def plain_entry(folder, sentences: list[list[str]], max_length: int, batch_size: int = 7) -> dict[int, np.ndarray]:
    """{sentence: (L, H, W, W) float32 word maps} of the sentences of at most ``max_length`` pieces: the model's
    tokenizer on the words joined by spaces, padded batches of ``batch_size`` through a plain eager transformers
    model with ``output_attentions``, rows averaged and columns summed over each word's pieces by loops
    (``tests.reference``: the words of the pieces and the pooling; W = words + 2: the first special, the words, the
    last special)."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    texts = [" ".join(words) for words in sentences]
    keep = [i for i, t in enumerate(texts) if len(tok(t)["input_ids"]) <= max_length]
    out = {}
    for b in range(0, len(keep), batch_size):
        ids = keep[b:b + batch_size]
        enc = tok([texts[i] for i in ids], padding=True, return_tensors="pt")
        with torch.no_grad():
            attn = torch.stack(model(**enc, output_attentions=True).attentions, 1)  # (B, L, H, T, T)
        for k, i in enumerate(ids):
            T = int(enc["attention_mask"][k].sum())  # right padding: the first T positions are real
            own, wids = text_pieces(tok, sentences[i])  # the sentence's pieces alone, their words
            assert enc["input_ids"][k, :T].tolist() == own
            groups = word_groups(wids, len(sentences[i]))  # W groups: first special, words, last special
            out[i] = pool_by_loops(attn[k, :, :, :T, :T].numpy(), groups).astype(np.float32)
    return out


def eager_word_maps(model: torch.nn.Module, tokenizer, words: list[str], bos: bool = False
                    ) -> tuple[np.ndarray, list[str]]:
    """(L, H, R, R) word maps of a plain eager forward of one sentence as running text (:func:`text_pieces`),
    pooled by :func:`pool_by_loops`; R rows: the specials before the words (where any), the words, the specials
    after (where any). ``model``: loaded with ``attn_implementation="eager"``. Returns (maps, row labels)."""
    ids, wids = text_pieces(tokenizer, words, bos)
    with torch.no_grad():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    att = torch.stack(att)[:, 0].double().numpy()  # (L, H, T, T)
    groups = word_groups(wids, len(words))
    labels = list(words)
    if wids[0] is None:
        labels = [tokenizer.convert_ids_to_tokens(ids[0])] + labels
    if wids[-1] is None:
        labels = labels + [tokenizer.convert_ids_to_tokens(ids[-1])]
    return pool_by_loops(att, groups), labels


def pooling_by_hand(word_of_piece: list[int], n_words: int, mode: str) -> torch.Tensor:
    """(W, T) word pooling matrix, W = n_words + 2, written out entry by entry (the reference for
    :func:`probes.model.inputs.pooling_matrix`): row 0 = the first special token, rows 1..n_words = the
    words, row W - 1 = the last special token (``word_of_piece`` -1 and n_words); ``sum``: 1 on each of the
    row's pieces, ``mean``: 1 / its piece count, ``first``: 1 on its first piece only."""
    T, W = len(word_of_piece), n_words + 2
    m = torch.zeros(W, T)
    for row in range(W):
        pieces = [t for t in range(T) if word_of_piece[t] + 1 == row]
        for t in pieces:
            if mode == "sum":
                m[row, t] = 1.0
            elif mode == "mean":
                m[row, t] = 1.0 / len(pieces)
            elif mode == "first" and t == pieces[0]:
                m[row, t] = 1.0
    return m


def head_attributions_stepwise(model: torch.nn.Module, input_ids: torch.Tensor, method: str = "ig", steps: int = 20,
                               chunk_size: int | None = 256, baseline: torch.Tensor | None = None) -> torch.Tensor:
    """The unbatched path :func:`probes.measures.gradflow.head_attributions` replaced (kept as its reference and
    as the "before" of ``bench/attribution_cost.py``): per layer and per IG step (or the one point of
    ``ixg``) one forward of the truncated model on ONE point, one ``vjp`` and ``vmap`` over the ``H * T``
    one-hot cotangents; ``hta``: the gradient's 2-norm. Returns (L, H, T, T)."""
    x = gradflow.word_embeddings(model, input_ids)  # (T, E)
    T = x.shape[0]
    out = []
    for layer in range(gradflow.num_layers(model)):
        f = gradflow.layer_head_scalars_fn(model, input_ids, layer)  # (T, E) -> (H, T)
        if method == "ixg":
            attr = gradflow.input_x_gradient(f, x, chunk_size)  # (H*T, T, E)
        elif method == "ig":
            attr = gradflow.integrated_gradients(f, x, baseline, steps, chunk_size)  # step loop
        elif method == "hta":
            _, J = gradflow.jacobian_rows(f, x, chunk_size)
            mass = torch.linalg.vector_norm(J, dim=-1).reshape(-1, T, T)  # (H, T, T)
            out.append(mass / mass.sum(-1, keepdim=True).clamp_min(1e-30))
            continue
        else:
            raise ValueError(method)
        out.append(gradflow.attribution_distribution(attr.reshape(-1, T, *x.shape)))  # (H, T, T)
    return torch.stack(out).detach()  # (L, H, T, T)


PIECE_MARKERS = ("##", "\u0120", "\u2581")  # WordPiece continuation, byte-level BPE space, SentencePiece space


def conllu_documents(docs: list[list[str]]) -> str:
    """A CoNLL-U file of documents (``# newdoc id = doc<d>``), each a list of sentences given as space-separated
    words, every word's head the word before it."""
    out = []
    for d, sents in enumerate(docs):
        out.append(f"# newdoc id = doc{d}")
        for k, s in enumerate(sents):
            out.append(f"# sent_id = doc{d}-{k}")
            out += [f"{i + 1}\t{w}\t_\t_\t_\t_\t{i}\t{'root' if i == 0 else 'dep'}\t_\t_"
                    for i, w in enumerate(s.split())]
            out.append("")
    return "\n".join(out) + "\n"


def reference_inputs(tok, sentences, pairs: bool) -> list[tuple[dict, list[str], list[bool]]]:
    """(the tokenizer's inputs, piece strings without markers, special-token flags) of every sequence, the tokenizer
    on the raw text: each sentence alone, or consecutive sentences of a document as the tokenizer's own pair."""
    texts = [(" ".join(s.words),) for s in sentences]
    if pairs:
        texts, i = [], 0
        while i + 1 < len(sentences):
            if sentences[i].doc_id == sentences[i + 1].doc_id:
                texts.append((" ".join(sentences[i].words), " ".join(sentences[i + 1].words)))
                i += 2
            else:
                i += 1
    out = []
    for t in texts:
        enc = tok(*t, return_special_tokens_mask=True)
        pieces = []
        for p in tok.convert_ids_to_tokens(enc["input_ids"]):
            for m in PIECE_MARKERS:
                p = p[len(m):] if p.startswith(m) else p
            pieces.append(p)
        inputs = {k: enc[k] for k in ("input_ids", "token_type_ids") if k in enc}
        out.append((inputs, pieces, [bool(x) for x in enc["special_tokens_mask"]]))
    return out


def eager_maps(eager: torch.nn.Module, inputs: dict) -> np.ndarray:
    """(L, H, T, T) float64 of one plain eager forward of one sequence's ``inputs``."""
    with torch.no_grad():
        att = eager(**{k: torch.tensor([v]) for k, v in inputs.items()}, output_attentions=True).attentions
    return torch.stack(att)[:, 0].double().numpy()  # (L, H, T, T)


def head_stats_by_loops(att: np.ndarray, pieces: list[str], special: list[bool], s: float = 1e-4
                        ) -> dict[str, np.ndarray]:
    """Clark et al.'s statistics of one sequence's (L, H, T, T) map by loops, (L, H) each: separators are the
    specials after position 0, punctuation the ``.`` / ``,`` pieces that are not specials and not at either end;
    entropies of the rows smoothed as ``(1 - s) a + s / T``."""
    L, H, T, _ = att.shape
    seps = [j for j in range(1, T) if special[j]]
    punct = [j for j in range(1, T - 1) if pieces[j] in (".", ",") and not special[j]]
    names = ("prev", "self", "next", "cls", "sep", "sep_sep", "rest_sep", "punct", "entropy", "cls_entropy")
    out = {k: np.zeros((L, H)) for k in names}
    for l in range(L):
        for h in range(H):
            a = att[l, h]
            ents = []
            for i in range(T):
                y = [(1 - s) * a[i, j] + s / T for j in range(T)]
                ents.append(-sum(v * math.log(v) for v in y))
            out["prev"][l, h] = sum(a[i, i - 1] for i in range(1, T)) / T
            out["self"][l, h] = sum(a[i, i] for i in range(T)) / T
            out["next"][l, h] = sum(a[i, i + 1] for i in range(T - 1)) / T
            out["cls"][l, h] = sum(a[i, 0] for i in range(T)) / T
            to_sep = [sum(a[i, j] for j in seps) for i in range(T)]
            out["sep"][l, h] = sum(to_sep) / T
            rest = [i for i in range(T) if i not in seps]
            out["sep_sep"][l, h] = sum(to_sep[i] for i in seps) / len(seps) if seps else float("nan")
            out["rest_sep"][l, h] = sum(to_sep[i] for i in rest) / len(rest) if rest else float("nan")
            out["punct"][l, h] = sum(a[i, j] for i in range(T) for j in punct) / T
            out["entropy"][l, h] = sum(ents) / T
            out["cls_entropy"][l, h] = ents[0]
    return out
