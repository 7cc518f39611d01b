"""``analysis=long_coref`` (coreference heads on whole documents): per-head predictions against an independent slow
reference, on a tiny random decoder and a tiny encoder, on whole maps and in blocks of a few query rows; distances,
their buckets and the segment flags; a document longer than the model reads skipped with its reason; bad keys named
before any forward.

The reference is written here from the raw text: the model's own tokenizer on the words joined by single spaces
(its offsets give every piece its word), one plain ``attn_implementation="eager"`` forward with
``output_attentions=True``, word pooling by Python loops (a row the mean over the word's pieces, a column the sum),
the argmax by a loop, distances and segments by loops; nothing of :mod:`probes.model.inputs` or
:mod:`probes.maps`. The documents' mentions come from the LitBank reader (:func:`probes.data.coref.read_litbank`).
"""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

import probes
from probes.analysis.beyond.long_coref import (bucket_bounds, bucket_label, distance_bucket, document_predictions,
                                               nearest_antecedent, prepare, row_predictions)
from probes.analysis.clark.coref_heads import Segment, head_predictions, segment_items
from probes.config import compose
from probes.data.coref import read_litbank
from probes.maps import MapEngine
from probes.model.inputs import encode_words
from probes.model.tiny import tiny_folder

MAX_POSITIONS = 256
FAMILIES = {"llama": AutoModelForCausalLM, "bert": AutoModelForMaskedLM}
# queries and keys scaled by this: a random tiny model's attention is nearly uniform (the best word of a row leads the
# next by 1e-6), a sharper one has clear maxima (by 1e-4 and more), so that every path must agree exactly
SHARPEN = 10.0
FILLER = "The weather was bright and quiet all day ."
# sentences with brackets: "[k" opens a mention of cluster k at the next word, "]" closes the last one opened
DOCS = {
    "a_short": ["[0 John ] saw [1 the old dog ] near [2 the river ] .",
                "[0 He ] liked [1 it ] .",
                FILLER,
                "[1 The dog ] ran to [2 the river ] with [0 John ] .",
                "[3 [0 His ] friend Mary ] called [0 him ] .",
                "[3 She ] was happy ."],
    "b_long": ["[5 The captain ] watched [6 the ship ] .",
               *[FILLER] * 6,
               "[6 It ] sailed away from [7 the town ] .",
               *[FILLER] * 4,
               "[5 He ] never saw [6 the ship ] or [7 the town ] again , and [5 the captain ] wept .",
               "[7 Its ] people forgot [5 him ] ."],
    "c_too_long": ["[8 A man ] came .", *[FILLER] * 40, "[8 He ] left ."],
}
SEGMENTS = (16, 48)
BLOCKS_MB = 0.03  # extract.attention_budget_mb of blocks of 2-10 query rows here
ATOL = 1e-6  # float32 against float64: the pooled values differ by about 1e-7


def conll(doc_id: str, sentences: list[str]) -> str:
    """A LitBank-style CoNLL-2012 file of the bracketed sentences."""
    lines = [f"#begin document ({doc_id}); part 0"]
    for s in sentences:
        words, cols, opened, pending = [], [], [], []
        for tok in s.split():
            if tok.startswith("["):
                pending.append(tok[1:])
            elif tok == "]":
                k, at = opened.pop()
                last = len(words) - 1
                if at == last:  # a one-word mention: "(k" becomes "(k)"
                    cols[at][cols[at].index(f"({k}")] = f"({k})"
                else:
                    cols[last].append(f"{k})")
            else:
                words.append(tok)
                cols.append([f"({k}" for k in pending])
                opened += [(k, len(words) - 1) for k in pending]
                pending = []
        assert not opened and not pending, s
        for i, (w, c) in enumerate(zip(words, cols)):
            lines.append("\t".join([doc_id, "0", str(i), w] + ["_"] * 8 + ["|".join(c) or "_"]))
        lines.append("")
    return "\n".join(lines + ["#end document", ""])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("long-coref-data")
    folder = root / "litbank_coref" / "conll"
    folder.mkdir(parents=True)
    for doc_id, sents in DOCS.items():
        (folder / f"{doc_id}.conll").write_text(conll(doc_id, sents))
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (encoder on the project's path, eager model, tokenizer) of a tiny model with sharpened attention."""
    root = tmp_path_factory.mktemp("tiny-long-coref")
    out = {}
    for family, cls in FAMILIES.items():
        folder = root / f"{family}-sharp"
        shutil.copytree(tiny_folder(family, root=root, max_positions=MAX_POSITIONS), folder)
        model = cls.from_pretrained(folder)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")):
                    p.mul_(SHARPEN)
        model.save_pretrained(folder)
        out[family] = (probes.load_encoder(str(folder)),
                       AutoModel.from_pretrained(folder, attn_implementation="eager").eval(),
                       AutoTokenizer.from_pretrained(folder))
    return out


# ----------------------------------------------------------------------------- the reference
def pieces_of(tok, words: list[str]) -> tuple[list[int], list[int | None]]:
    """(ids, word of every piece, None for a special) of the words as running text, from the tokenizer's offsets."""
    text = " ".join(words)
    owner = []  # owner[c]: the word of character c, None for the spaces
    for k, w in enumerate(words):
        owner += [k] * len(w) + [None]
    enc = tok(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    wids = []
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        hit = [owner[c] for c in range(a, b) if owner[c] is not None]
        if enc["special_tokens_mask"][t]:
            wids.append(None)
        elif hit:
            wids.append(hit[0])
        else:  # a piece of spaces alone: the next word's
            wids.append(next(owner[c] for c in range(b, len(text)) if owner[c] is not None))
    return list(enc["input_ids"]), wids


def reference_predictions(model, tok, words: list[str], heads: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """((L, H, M) the most-attended word of each head word (itself and the specials ignored, the first on ties),
    (L, H, M) the margin of that word over the runner-up) by loops over one eager forward's attention."""
    ids, wids = pieces_of(tok, words)
    with torch.no_grad():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    att = torch.stack(att)[:, 0].double().numpy()  # (L, H, T, T)
    L, H, T, _ = att.shape
    pred, margin = np.zeros((L, H, len(heads)), dtype=int), np.zeros((L, H, len(heads)))
    for m, h in enumerate(heads):
        rows = [t for t in range(T) if wids[t] == h]
        for l in range(L):
            for hh in range(H):
                score = [0.0] * len(words)
                for t in rows:
                    for s in range(T):
                        if wids[s] is not None:
                            score[wids[s]] += att[l, hh, t, s] / len(rows)
                best, second = -1, -np.inf
                for w in range(len(words)):
                    if w == h:
                        continue
                    if best < 0 or score[w] > score[best]:
                        second = score[best] if best >= 0 else second
                        best = w
                    else:
                        second = max(second, score[w])
                pred[l, hh, m], margin[l, hh, m] = best, score[best] - second
    return pred, margin


def reference_mentions(doc) -> list[tuple[int, list[int]]]:
    """(head word, antecedent head words) of every mention with an earlier mention of its cluster whose head word
    differs, in (start, end) order."""
    ms = sorted(doc.mentions, key=lambda m: (m.start, m.end))
    out = []
    for k, m in enumerate(ms):
        ants = sorted({c.head for c in ms[:k] if c.cluster == m.cluster and c.head != m.head})
        if ants:
            out.append((m.head, ants))
    return out


def reference_segments(tok, doc, length: int) -> list[int]:
    """The segment of every word: whole sentences added while the joined text stays within ``length`` pieces; a
    sentence longer than that alone is in none (-1) and the next one starts a new segment."""
    n = lambda sents: len(tok(" ".join(w for x in sents for w in x.words))["input_ids"])  # noqa: E731
    seg, cur, k = [], [], -1
    for s in doc.sentences:
        if n([s]) > length:
            seg += [-1] * len(s.words)
            cur = []
            continue
        if not cur or n(cur + [s]) > length:
            cur, k = [], k + 1
        cur.append(s)
        seg += [k] * len(s.words)
    return seg


def read(path) -> list[dict]:
    return list(csv.DictReader(open(path)))


# ----------------------------------------------------------------------------- tests
def test_distance_buckets():
    assert [distance_bucket(d) for d in (1, 2, 3, 4, 7, 8, 15, 16, 1000)] == [0, 1, 1, 2, 2, 3, 3, 4, 9]
    assert [bucket_label(k) for k in range(4)] == ["1", "2-3", "4-7", "8-15"]
    assert bucket_bounds(9) == (512, 1023)
    for d in range(1, 300):
        lo, hi = bucket_bounds(distance_bucket(d))
        assert lo <= d <= hi
    with pytest.raises(ValueError, match="distance 0"):
        distance_bucket(0)
    assert nearest_antecedent(10, [4, 7, 13]) == 7 and nearest_antecedent(10, [7, 13]) == 7  # a tie: the earlier
    assert nearest_antecedent(10, [2, 11]) == 11


def test_row_predictions_follow_coref_heads_convention():
    """The rows of the mentions' head words of a full word map give what coref_heads' head_predictions gives on the
    full map (specials and the word itself ignored; exact ties: the first word)."""
    rng = np.random.default_rng(0)
    L, H, n = 2, 3, 12
    attn = rng.random((L, H, n + 2, n + 2)).astype(np.float32)  # (L, H, W, W)
    attn[0, 0, 1 + 4, 1:n + 1] = 0.5  # a row of ties
    heads = np.array([0, 4, 7, 11])
    np.testing.assert_array_equal(row_predictions(attn[:, :, heads + 1, :], heads), head_predictions(attn, heads))
    assert row_predictions(attn[:, :, heads + 1, :], heads)[0, 0, 1] == 0


def litbank_docs(data) -> dict:
    return {d.doc_id: d.without_singletons() for d in read_litbank(data / "litbank_coref" / "conll")}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_per_head_predictions_match_eager_loops_on_whole_maps_and_in_blocks(models, data, family):
    enc, eager, tok = models[family]
    docs = litbank_docs(data)
    got = {}
    for budget in (1024, BLOCKS_MB):  # whole maps; blocks of a few query rows
        extract = compose("analyze", [f"extract.attention_budget_mb={budget}"]).extract
        engine = MapEngine.from_config(extract, enc.model, kind="attention", tokenizer=enc.tokenizer, device="cpu",
                                       max_length=None)
        for doc_id in ("a_short", "b_long"):
            doc = docs[doc_id]
            items = segment_items(doc, Segment(0, 0, len(doc.sentences), 0, len(doc.words), 0), 0)
            (encoded,) = encode_words(enc.tokenizer, [doc.words])
            rows = engine.rows_per_block(1, encoded.n_pieces)
            assert rows is None if budget == 1024 else 1 < rows < encoded.n_pieces // 3
            p = prepare(enc.tokenizer, doc, 0, encoded, items, SEGMENTS)
            got[budget, doc_id] = p.heads, document_predictions(engine, p)  # (L, H, M)
    for doc_id in ("a_short", "b_long"):
        heads = sorted({h for h, _ in reference_mentions(docs[doc_id])})
        want, margin = reference_predictions(eager, tok, docs[doc_id].words, heads)
        assert margin.min() > ATOL  # no tie within float error: the argmax is the same on any path
        for budget in (1024, BLOCKS_MB):
            assert got[budget, doc_id][0] == heads
            np.testing.assert_array_equal(got[budget, doc_id][1], want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_analysis_matches_eager_loops_on_whole_maps_and_in_blocks(models, data, tmp_path, family):
    enc, eager, tok = models[family]
    runs = {}
    for path, budget in (("whole", 1024), ("blocks", BLOCKS_MB)):
        out = tmp_path / path
        probes.analyze("long_coref", encoder=enc, output_dir=out, figures=path == "whole",
                       overrides=[f"paths.data_dir={data}", f"extract.attention_budget_mb={budget}",
                                  "analysis_device=cpu"], segment_lengths=list(SEGMENTS))
        runs[path] = out
    docs = litbank_docs(data)
    summary = json.loads((runs["whole"] / "summary.json").read_text())
    blocks = json.loads((runs["blocks"] / "summary.json").read_text())
    n = {k: len(pieces_of(tok, d.words)[0]) for k, d in docs.items()}
    assert n["c_too_long"] > MAX_POSITIONS >= max(n["a_short"], n["b_long"])
    assert summary["skipped"] == {"c_too_long": f"{n['c_too_long']} pieces, above {enc.name}'s usable length of "
                                                f"{MAX_POSITIONS} pieces"} == blocks["skipped"]
    assert summary["n_skipped"] == 1 and summary["n_documents"] == 2
    for doc_id in ("a_short", "b_long"):
        assert summary["documents"][doc_id]["rows_per_block"] is None
        assert 1 < blocks["documents"][doc_id]["rows_per_block"] < n[doc_id] // 3  # blocks of a few rows
        assert summary["documents"][doc_id]["n_pieces"] == n[doc_id]
    # the reference: hits of every head on every mention, distances, segments
    hits, dist, within = [], {"words": [], "pieces": []}, {s: [] for s in SEGMENTS}
    want_rows = []
    for doc_id in ("a_short", "b_long"):
        doc = docs[doc_id]
        mentions = reference_mentions(doc)
        heads = sorted({h for h, _ in mentions})
        pred, margin = reference_predictions(eager, tok, doc.words, heads)
        assert margin.min() > ATOL  # no tie within float error: the argmax is the same on any path
        _, wids = pieces_of(tok, doc.words)
        first = [wids.index(w) for w in range(len(doc.words))]
        segs = {s: reference_segments(tok, doc, s) for s in SEGMENTS}
        for h, ants in mentions:
            p = pred[:, :, heads.index(h)]  # (L, H)
            hits.append(np.isin(p, ants))
            a = min(ants, key=lambda x: (abs(h - x), x > h))
            dist["words"].append(abs(h - a))
            dist["pieces"].append(abs(first[h] - first[a]))
            for s in SEGMENTS:
                within[s].append(segs[s][h] >= 0 and any(segs[s][x] == segs[s][h] for x in ants))
            want_rows.append((doc_id, h))
    hits = np.stack(hits)  # (N, L, H)
    L, H = hits.shape[1:]
    assert len({distance_bucket(d) for d in dist["pieces"]}) >= 4 and 0 < sum(within[SEGMENTS[0]]) < len(hits)
    assert 0 < hits.mean() < 1
    for path, out in runs.items():
        mentions = read(out / "long_coref_mentions.csv")
        assert [(r["doc_id"], int(r["head_word"])) for r in mentions] == want_rows
        for unit in ("words", "pieces"):
            assert [int(r[f"distance_{unit}"]) for r in mentions] == dist[unit]
        for s in SEGMENTS:
            assert [r[f"within_{s}"] == "True" for r in mentions] == within[s]
        rows = read(out / "long_coref.csv")
        assert len({(r["unit"], r["bucket"]) for r in rows}) * L * H == len(rows)
        for r in rows:
            d = np.array(dist[r["unit"]])
            mask = np.ones(len(d), dtype=bool) if r["bucket"] == "all" else \
                (d >= int(r["lo"])) & (d <= int(r["hi"]))
            assert int(r["count"]) == mask.sum() > 0
            assert float(r["accuracy"]) == pytest.approx(hits[mask, int(r["layer"]), int(r["head"])].mean()), (path, r)
        best = np.unravel_index(int(np.argmax(hits.mean(0))), (L, H))
        by = read(out / "long_coref_by_distance.csv")
        for r in by:
            d = np.array(dist[r["unit"]])
            mask = np.ones(len(d), dtype=bool) if r["bucket"] == "all" else \
                (d >= int(r["lo"])) & (d <= int(r["hi"]))
            assert float(r["best_head"]) == pytest.approx(hits[mask, best[0], best[1]].mean())
            for s in SEGMENTS:
                assert int(r[f"within_{s}"]) == int(np.array(within[s])[mask].sum())
        assert summary["best_head"]["layer"] == best[0] and summary["best_head"]["head"] == best[1]
    assert (runs["whole"] / "long_coref.png").is_file()


def test_bad_keys_named_before_any_forward(models, data, tmp_path):
    enc, _, _ = models["llama"]
    calls = []
    hook = enc.model.register_forward_pre_hook(lambda *a: calls.append(1))
    over = [f"paths.data_dir={data}", "analysis_device=cpu"]
    try:
        for params, key in ((dict(max_documents=0), "analysis.max_documents"),
                            (dict(segment_lengths=[2]), "analysis.segment_lengths"),
                            (dict(layers=[7]), "analysis.layers"), (dict(source="books"), "analysis.source")):
            with pytest.raises(ValueError, match=key):
                probes.analyze("long_coref", encoder=enc, output_dir=tmp_path / "bad", overrides=over, **params)
        with pytest.raises(ValueError, match="no document .* can be scored.*c_too_long.*usable length"):
            _only_too_long(enc, data, tmp_path)
    finally:
        hook.remove()
    assert not calls


def _only_too_long(enc, data, tmp_path):
    """long_coref on a folder holding only the too-long document."""
    folder = tmp_path / "only" / "litbank_coref" / "conll"
    folder.mkdir(parents=True)
    (folder / "c_too_long.conll").write_text((data / "litbank_coref" / "conll" / "c_too_long.conll").read_text())
    return probes.analyze("long_coref", encoder=enc, output_dir=tmp_path / "none",
                          overrides=[f"paths.data_dir={tmp_path / 'only'}", "analysis_device=cpu"])
