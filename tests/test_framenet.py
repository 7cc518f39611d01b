"""FrameNet 1.7 full-text reader and `analysis=framenet_heads` (Kovaleva et al. §4.1) on files written
in the release's XML schema (a discontinuous target, a multi-token target, a discontinuous frame
element, a sentence without a POS layer, null instantiations, a rank-2 FE layer), checked against
hand-written word spans and an independent loop over a plain tiny-BERT forward."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from probes.analysis.context import AnalysisContext
from probes.data.framenet import FrameLink, framenet_root, read_framenet
from tests.conftest import ROOT

FULLTEXT = """<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<?xml-stylesheet type="text/xsl" href="fullText.xsl"?>
<fullTextAnnotation xmlns="http://framenet.icsi.berkeley.edu" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
    <header>
        <corpus description="Test corpus" name="TEST" ID="900">
            <document description="Tiny" name="Tiny" ID="9000"/>
        </corpus>
    </header>
    <sentence corpID="900" docID="9000" sentNo="1" paragNo="1" aPos="0" ID="1">
        <text>Kim looked the word up in a big dictionary .</text>
        <annotationSet cDate="01/01/2010 10:00:00 PST Fri" status="UNANN" ID="11">
            <layer rank="1" name="PENN">
                <label end="2" start="0" name="NP"/>
                <label end="9" start="4" name="VVD"/>
                <label end="13" start="11" name="DT"/>
                <label end="18" start="15" name="NN"/>
                <label end="21" start="20" name="RP"/>
                <label end="24" start="23" name="IN"/>
                <label end="26" start="26" name="DT"/>
                <label end="30" start="28" name="JJ"/>
                <label end="41" start="32" name="NN"/>
                <label end="43" start="43" name="sent"/>
            </layer>
            <layer rank="1" name="NER"/>
            <layer rank="1" name="WSL"/>
        </annotationSet>
        <annotationSet cDate="01/01/2010 10:00:00 PST Fri" luID="101" luName="look up.v" frameID="1" frameName="Scrutiny" status="MANUAL" ID="12">
            <layer rank="1" name="Target">
                <label cBy="ABC" end="9" start="4" name="Target"/>
                <label cBy="ABC" end="21" start="20" name="Target"/>
            </layer>
            <layer rank="1" name="FE">
                <label cBy="ABC" feID="11" bgColor="FF0000" fgColor="FFFFFF" end="2" start="0" name="Cognizer"/>
                <label cBy="ABC" feID="12" bgColor="0000FF" fgColor="FFFFFF" end="18" start="11" name="Ground"/>
                <label cBy="ABC" feID="13" bgColor="00FF00" fgColor="000000" end="41" start="23" name="Instrument"/>
                <label cBy="ABC" feID="14" bgColor="FF00FF" fgColor="FFFFFF" itype="INI" name="Phenomenon"/>
            </layer>
            <layer rank="1" name="GF">
                <label end="2" start="0" name="Ext"/>
            </layer>
            <layer rank="1" name="PT">
                <label end="2" start="0" name="NP"/>
            </layer>
            <layer rank="1" name="Verb"/>
        </annotationSet>
        <annotationSet cDate="01/01/2010 10:00:00 PST Fri" luID="102" luName="big.a" frameID="2" frameName="Size" status="MANUAL" ID="13">
            <layer rank="1" name="Target">
                <label cBy="ABC" end="30" start="28" name="Target"/>
            </layer>
            <layer rank="1" name="FE">
                <label cBy="ABC" feID="21" bgColor="FF0000" fgColor="FFFFFF" end="41" start="32" name="Entity"/>
            </layer>
        </annotationSet>
    </sentence>
    <sentence corpID="900" docID="9000" sentNo="2" paragNo="1" aPos="45" ID="2">
        <text>The meeting will take place on Monday .</text>
        <annotationSet cDate="01/01/2010 10:00:00 PST Fri" status="UNANN" ID="21">
            <layer rank="1" name="PENN">
                <label end="2" start="0" name="DT"/>
                <label end="10" start="4" name="NN"/>
                <label end="15" start="12" name="MD"/>
                <label end="20" start="17" name="VV"/>
                <label end="26" start="22" name="NN"/>
                <label end="29" start="28" name="IN"/>
                <label end="36" start="31" name="NP"/>
                <label end="38" start="38" name="sent"/>
            </layer>
        </annotationSet>
        <annotationSet cDate="01/01/2010 10:00:00 PST Fri" luID="103" luName="take place.v" frameID="3" frameName="Event" status="MANUAL" ID="22">
            <layer rank="1" name="Target">
                <label cBy="ABC" end="26" start="17" name="Target"/>
            </layer>
            <layer rank="1" name="FE">
                <label cBy="ABC" feID="31" bgColor="FF0000" fgColor="FFFFFF" end="10" start="0" name="Event"/>
                <label cBy="ABC" feID="32" bgColor="0000FF" fgColor="FFFFFF" end="36" start="28" name="Time"/>
            </layer>
            <layer rank="2" name="FE">
                <label cBy="ABC" feID="31" bgColor="FF0000" fgColor="FFFFFF" end="36" start="31" name="Event"/>
            </layer>
        </annotationSet>
    </sentence>
    <sentence corpID="900" docID="9000" sentNo="3" paragNo="2" aPos="85" ID="3">
        <text>What, she asked, is the answer?</text>
        <annotationSet cDate="01/01/2010 10:00:00 PST Fri" luID="104" luName="ask.v" frameID="4" frameName="Questioning" status="MANUAL" ID="31">
            <layer rank="1" name="Target">
                <label cBy="ABC" end="14" start="10" name="Target"/>
            </layer>
            <layer rank="1" name="FE">
                <label cBy="ABC" feID="41" bgColor="FF0000" fgColor="FFFFFF" end="8" start="6" name="Speaker"/>
                <label cBy="ABC" feID="42" bgColor="0000FF" fgColor="FFFFFF" end="29" start="17" name="Message"/>
                <label cBy="ABC" feID="42" bgColor="0000FF" fgColor="FFFFFF" end="3" start="0" name="Message"/>
            </layer>
        </annotationSet>
    </sentence>
</fullTextAnnotation>
"""

FRAME = """<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<?xml-stylesheet type="text/xsl" href="frame.xsl"?>
<frame cBy="ABC" cDate="01/01/2010 10:00:00 PST Fri" name="{name}" ID="{id}" xmlns="http://framenet.icsi.berkeley.edu" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
    <definition>&lt;def-root&gt;A test frame.&lt;/def-root&gt;</definition>
{fes}
    <lexUnit status="Finished_Initial" POS="V" name="x.v" ID="{id}0" lemmaID="1" cBy="ABC" cDate="01/01/2010 10:00:00 PST Fri">
        <definition>COD: test.</definition>
        <sentenceCount annotated="1" total="1"/>
        <lexeme order="1" headword="false" breakBefore="false" POS="V" name="x"/>
    </lexUnit>
</frame>
"""
FE = """    <FE bgColor="FF0000" fgColor="FFFFFF" coreType="{core}" cBy="ABC" cDate="01/01/2010 10:00:00 PST Fri" abbrev="{abbrev}" name="{name}" ID="{id}">
        <definition>&lt;def-root&gt;An FE.&lt;/def-root&gt;</definition>
    </FE>"""
FRAMES = {
    "Scrutiny": [("Cognizer", "Core"), ("Ground", "Core"), ("Phenomenon", "Core"), ("Instrument", "Peripheral")],
    "Size": [("Entity", "Core"), ("Degree", "Peripheral")],
    "Event": [("Event", "Core"), ("Time", "Peripheral")],
    "Questioning": [("Speaker", "Core"), ("Message", "Core"), ("Addressee", "Core")],
}


def write_framenet(data_dir, frames=FRAMES, layout=".") -> None:
    root = data_dir / "framenet" / layout
    (root / "fulltext").mkdir(parents=True)
    (root / "frame").mkdir()
    (root / "fulltext" / "TEST__Tiny.xml").write_text(FULLTEXT, encoding="utf-8")
    for i, (name, fes) in enumerate(frames.items(), start=1):
        body = "\n".join(FE.format(core=c, abbrev=n[:3], name=n, id=10 * i + j) for j, (n, c) in enumerate(fes))
        (root / "frame" / f"{name}.xml").write_text(FRAME.format(name=name, id=i, fes=body), encoding="utf-8")


# (sentence, frame, FE) -> (target words, element words); word indices by hand from the texts above
EXPECTED = {
    ("1", "Scrutiny", "Cognizer"): ((1, 4), (0,)),        # discontinuous target "looked ... up"
    ("1", "Scrutiny", "Ground"): ((1, 4), (2, 3)),
    ("1", "Size", "Entity"): ((7,), (8,)),
    ("2", "Event", "Event"): ((3, 4), (0, 1)),            # multi-token target "take place"
    ("3", "Questioning", "Speaker"): ((3,), (2,)),
    ("3", "Questioning", "Message"): ((3,), (0, 5, 6, 7)),  # discontinuous FE "What ... is the answer"
}


@pytest.fixture
def fn_data(tmp_path):
    write_framenet(tmp_path / "data")
    return tmp_path / "data"


def test_reader_words_targets_and_core_elements(fn_data):
    sents = read_framenet(fn_data)
    assert [s.id for s in sents] == ["1", "2", "3"]
    assert sents[0].words == "Kim looked the word up in a big dictionary .".split()
    assert sents[2].words == ["What", ",", "she", "asked", ",", "is", "the", "answer", "?"]  # no POS layer
    got = {(s.id, l.frame, l.fe): (l.target, l.element) for s in sents for l in s.links}
    assert got == EXPECTED  # Instrument, Time (peripheral), the INI Phenomenon and rank-2 FE left out
    msg = next(l for l in sents[2].links if l.fe == "Message")
    assert msg.element_chars == ((0, 4), (17, 30)) and msg.lu == "ask.v" and msg.core_type == "Core"
    assert next(l for l in sents[0].links if l.fe == "Ground").target_chars == ((4, 10), (20, 22))
    every = read_framenet(fn_data, keep=None)
    assert {l.fe for s in every for l in s.links} >= {"Instrument", "Time"}


def test_reader_layouts_and_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="framenet.*fulltext.*nltk.downloader framenet_v17"):
        read_framenet(tmp_path)
    write_framenet(tmp_path / "nltk", layout="framenet_v17")  # NLTK's folder below <data_dir>/framenet
    assert framenet_root(tmp_path / "nltk").name == "framenet_v17"
    assert len(read_framenet(tmp_path / "nltk", max_sentences=2)) == 2
    frames = {k: v for k, v in FRAMES.items() if k != "Size"}
    write_framenet(tmp_path / "nosize", frames)
    with pytest.raises(ValueError, match=r"TEST__Tiny.xml sentence ID=1: core type of frame element 'Entity'"):
        read_framenet(tmp_path / "nosize")
    bad = tmp_path / "bad"
    write_framenet(bad)
    f = bad / "framenet" / "fulltext" / "TEST__Tiny.xml"
    f.write_text(FULLTEXT.replace('end="41" start="32" name="Entity"', 'end="99" start="32" name="Entity"'))
    with pytest.raises(ValueError, match="sentence ID=1: label 'Entity' .32, 99. outside the text"):
        read_framenet(bad)


def _slow_scores(model, tokenizer, sentences):
    """Independent reference: each word tokenized alone, one plain forward per sentence with
    output_attentions, max over explicit loops; baseline = mean over every in-sentence shift."""
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    sums = {k: np.zeros((L, H)) for k in ("score", "t2f", "f2t", "baseline")}
    n = 0
    for s in sentences:
        ids, owner = [tokenizer.cls_token_id], [None]
        for w, word in enumerate(s.words):
            p = tokenizer(word, add_special_tokens=False)["input_ids"]
            ids += p
            owner += [w] * len(p)
        ids.append(tokenizer.sep_token_id)
        owner.append(None)
        with torch.no_grad():
            att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        att = np.stack([a[0].numpy() for a in att])  # (L, H, T, T)

        def score(tw, ew):
            tp = [t for t, o in enumerate(owner) if o in tw]
            ep = [t for t, o in enumerate(owner) if o in ew]
            t2f, f2t = np.zeros((L, H)), np.zeros((L, H))
            for l in range(L):
                for h in range(H):
                    t2f[l, h] = max(abs(att[l, h, i, j]) for i in tp for j in ep)
                    f2t[l, h] = max(abs(att[l, h, i, j]) for i in ep for j in tp)
            return t2f, f2t

        for link in s.links:
            t2f, f2t = score(link.target, link.element)
            sums["t2f"] += t2f
            sums["f2t"] += f2t
            sums["score"] += np.maximum(t2f, f2t)
            words = link.target + link.element
            ds = [d for d in range(-len(s.words), len(s.words)) if d
                  and all(0 <= w + d < len(s.words) for w in words)]
            sums["baseline"] += np.mean([np.maximum(*score([w + d for w in link.target],
                                                           [w + d for w in link.element])) for d in ds], axis=0)
            n += 1
    return {k: v / n for k, v in sums.items()}, n


def test_analysis_against_slow_loop(fn_data, tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=["analysis=framenet_heads", "encoder=tiny",
                                                       f"paths.data_dir={fn_data}"])
    ctx = AnalysisContext(cfg, tmp_path / "out", use_wandb=False)
    df = instantiate(cfg.analysis)(ctx)
    ref, n = _slow_scores(ctx.encoder.model, ctx.encoder.tokenizer, read_framenet(fn_data))
    L, H = 2, 4  # conf/encoder/tiny.yaml
    assert n == 6 and len(df) == L * H and (df.n_links == 6).all() and (df.n_baseline == 6).all()
    got = {c: df[c].to_numpy().reshape(L, H) for c in ("score", "target_to_fe", "fe_to_target", "baseline")}
    np.testing.assert_allclose(got["score"], ref["score"], atol=1e-6)
    np.testing.assert_allclose(got["target_to_fe"], ref["t2f"], atol=1e-6)
    np.testing.assert_allclose(got["fe_to_target"], ref["f2t"], atol=1e-6)
    np.testing.assert_allclose(got["baseline"], ref["baseline"], atol=1e-6)
    np.testing.assert_allclose(df.difference, df.score - df.baseline, atol=1e-12)  # every link has a shift
    assert list(df.name[:2]) == ["1-1", "1-2"] and (df.model == "pre-trained").all()
    saved = pd.read_csv(tmp_path / "out" / "framenet_heads.csv")
    assert len(saved) == L * H and (tmp_path / "out" / "framenet_heads.png").exists()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["models"]["pre-trained"]["n_links"] == 6 and summary["n_sentences_read"] == 3

    # a "fine-tuned" model: the same weights exported as an MRPC classifier folder -> the same scores
    from probes.glue.export import export_hf
    from probes.glue.module import SequenceClassifier

    export_hf(SequenceClassifier(ctx.encoder, task="mrpc"), tmp_path / "ft")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=[
            "analysis=framenet_heads", "encoder=tiny", f"paths.data_dir={fn_data}",
            f"analysis.checkpoint={tmp_path / 'ft'}", "analysis.max_element_words=3"])
    df2 = instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "out2", use_wandb=False))
    assert list(df2.model.unique()) == ["pre-trained", "fine-tuned (mrpc)"] and (df2.n_links == 5).all()
    pre, ft = (df2[df2.model == m].reset_index(drop=True) for m in ("pre-trained", "fine-tuned (mrpc)"))
    np.testing.assert_allclose(ft.score, pre.score, atol=1e-6)
    np.testing.assert_allclose(ft.baseline, pre.baseline, atol=1e-6)


def test_link_filters():
    from probes.analysis.kovaleva.framenet_heads import select_links
    from probes.data.framenet import FrameSentence

    def sent(n_words, element_sizes):
        links = [FrameLink("F", "x.v", f"E{k}", "Core", ((0, 1),), ((2, 3),), (0,), tuple(range(1, 1 + k)))
                 for k in element_sizes]
        return FrameSentence("s", "d", "", ["w"] * n_words, [(i, i + 1) for i in range(n_words)], links)

    out = select_links([sent(12, [1, 3, 4]), sent(13, [1]), sent(5, [5])], max_sentence_words=12,
                       max_element_words=3)
    assert [[l.fe for l in s.links] for s in out] == [["E1", "E3"]]
    assert len(select_links([sent(13, [1])])) == 1


def test_shifts_keep_shape_inside_the_sentence():
    from probes.analysis.kovaleva.framenet_heads import shifts

    assert shifts((3,), (0, 5, 6, 7), 9) == [1]
    assert shifts((1, 4), (0,), 10) == [1, 2, 3, 4, 5]
    assert shifts((7,), (8,), 10) == [-7, -6, -5, -4, -3, -2, -1, 1]
    assert shifts((0, 1), (2, 3), 4) == []
