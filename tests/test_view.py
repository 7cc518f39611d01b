"""Maps one can look at: ``WordMaps.plot`` (a labelled heatmap whose pixels are the map) and the HTML view
(``probes.view``, ``probes-view``) rendered in headless Chromium: the words, one thumbnail per layer and head,
and the drawn lines or cells equal to the selected map, for the selection the page's address names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

import probes
from probes.model.tiny import tiny_folder
from probes.report.mapview import LINE_MIN_SHARE, KindMaps, write_view
from probes.report.view import run
from tests.conftest import ROOT, find_browser

REPO = Path(__file__).resolve().parents[1]
SENTENCE = "The cat sat on the mat ."
CPU = ["extract.precision=32-true"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny random BERT (2 layers x 4 heads) of probes.model.tiny."""
    return tiny_folder("bert", root=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def encoder(folder):
    return probes.load_encoder(folder)


@pytest.fixture(scope="module")
def maps(encoder):
    """attention (per head) and rollout (per layer) of SENTENCE on the tiny BERT (2 layers x 4 heads)."""
    return {k: probes.word_maps(encoder, [SENTENCE], kind=k, device="cpu", overrides=CPU)[0]
            for k in ("attention", "rollout")}


# ----------------------------------------------------------------------------- WordMaps.plot
def test_plot_labels_title_and_pixels_are_the_map(maps):
    wm = maps["attention"]
    ax = wm.plot(1, 2)
    try:
        assert [t.get_text() for t in ax.get_xticklabels()] == wm.labels
        assert [t.get_text() for t in ax.get_yticklabels()] == wm.labels
        assert ax.get_title() == "attention 2-3" and ax.get_xlabel() == "to" and ax.get_ylabel() == "from"
        [img] = ax.get_images()
        np.testing.assert_array_equal(np.asarray(img.get_array()), wm.maps[1, 2])
        assert img.get_clim() == (0.0, float(wm.maps[1, 2].max()))
        assert img.get_extent() == [-0.5, len(wm.labels) - 0.5, len(wm.labels) - 0.5, -0.5]  # row 0 at the top
    finally:
        plt.close(ax.figure)
    fig, axes = plt.subplots(1, 2)
    try:
        roll = maps["rollout"]
        assert roll.plot(0, ax=axes[1], colorbar=False) is axes[1] and axes[1].get_title() == "rollout layer 1"
        np.testing.assert_array_equal(np.asarray(axes[1].get_images()[0].get_array()), roll.maps[0, 0])
        with pytest.raises(ValueError, match="layer 5 was not computed"):
            roll.plot(5)
        with pytest.raises(ValueError, match="head 1 does not exist"):
            roll.plot(0, 1)
    finally:
        plt.close(fig)


def test_plot_of_signed_map_is_centred_on_zero():
    wm = probes.WordMaps(["a", "b"], ["a", "b"], np.array([[[[0.5, -2.0], [1.0, 0.0]]]], dtype=np.float32), [3],
                         "grad_attribution")
    ax = wm.plot(3)
    try:
        assert ax.get_title() == "grad_attribution layer 4"
        assert ax.get_images()[0].get_clim() == (-2.0, 2.0)
    finally:
        plt.close(ax.figure)


# ----------------------------------------------------------------------------- the HTML view
class Tags(HTMLParser):
    """Every start tag of a page as (name, attributes); the text of every element."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def find(self, name: str, cls: str | None = None) -> list[dict[str, str]]:
        want = set((cls or "").split())
        return [a for t, a in self.tags if t == name and want <= set((a.get("class") or "").split())]


def render(browser: str, page: Path, fragment: str, profile: Path) -> Tags:
    """The page's DOM after its script ran, opened at ``#fragment``."""
    url = page.as_uri() + (f"#{fragment}" if fragment else "")
    out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          f"--user-data-dir={profile}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=180)
    assert "<body" in out.stdout, out.stderr[-2000:]
    return Tags(out.stdout)


def drawn(dom: Tags, name: str, R: int) -> np.ndarray:
    """The (R, R) values the big view drew (``line`` or ``rect`` elements); NaN where nothing was drawn."""
    m = np.full((R, R), np.nan)
    for a in dom.find(name):
        if "data-from" in a:
            m[int(a["data-from"]), int(a["data-to"])] = float(a["data-value"])
    return m


def expected_lines(m: np.ndarray) -> np.ndarray:
    """The lines view of map ``m``: the values of at least LINE_MIN_SHARE of the largest |value|, NaN elsewhere."""
    return np.where(np.abs(m) >= LINE_MIN_SHARE * np.abs(m).max(), m, np.nan)


def test_view_renders_in_chromium(maps, tmp_path):
    browser = find_browser()
    att, roll = maps["attention"], maps["rollout"]
    R, (L, H) = len(att.labels), att.maps.shape[:2]
    page = probes.view([att, roll], tmp_path / "out" / "view.html", title="tiny: a sentence")
    text = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|<link|@import|url\(""", text)  # nothing fetched
    assert [p.name for p in page.parent.iterdir()] == ["view.html"]  # written in place, no temporary left

    first = render(browser, page, "", tmp_path / "profile")
    body = first.find("body")[0]
    assert (body["data-kind"], body["data-layer"], body["data-head"], body["data-mode"]) == ("attention", "1", "1",
                                                                                            "lines")
    thumbs = first.find("a", "thumb")
    assert len(thumbs) == L * H == 8
    cells = {(a["data-layer"], a["data-head"]) for a in thumbs}
    assert cells == {(str(layer), str(head)) for layer in (1, 2) for head in (1, 2, 3, 4)}
    assert [a["href"] for a in first.find("a", "thumb sel")] == ["#kind=attention&layer=1&head=1&mode=lines"]
    words = [t.strip() for t in first.text if t.strip()]
    for w in att.labels:
        assert words.count(w) >= 2, w  # both columns of the lines view
    assert "tiny: a sentence" in words and "attention 1-1 (layer 1, head 1)" in words
    np.testing.assert_allclose(drawn(first, "line", R), expected_lines(att.maps[0, 0]), rtol=1e-6, atol=1e-9)

    # the selection a thumbnail's link names: another head, other values drawn
    other = render(browser, page, "kind=attention&layer=2&head=3&mode=lines", tmp_path / "profile")
    assert [a["href"] for a in other.find("a", "thumb sel")] == ["#kind=attention&layer=2&head=3&mode=lines"]
    assert other.find("body")[0]["data-head"] == "3"
    got = drawn(other, "line", R)
    np.testing.assert_allclose(got, expected_lines(att.maps[1, 2]), rtol=1e-6, atol=1e-9)
    assert not np.allclose(np.nan_to_num(got), np.nan_to_num(drawn(first, "line", R)))

    # another kind (per layer: one thumbnail a layer) as a matrix: every cell drawn
    mat = render(browser, page, "kind=rollout&layer=2&head=1&mode=matrix", tmp_path / "profile")
    assert len(mat.find("a", "thumb")) == roll.maps.shape[0] == 2 and roll.maps.shape[1] == 1
    assert "rollout layer 2" in [t.strip() for t in mat.text]
    assert len([a for a in mat.find("rect") if "data-from" in a]) == R * R
    np.testing.assert_allclose(drawn(mat, "rect", R), roll.maps[1, 0], rtol=1e-6, atol=1e-9)


def test_view_labels_are_text_never_markup(tmp_path):
    """Labels that look like markup are shown as written; the data block cannot end the script element."""
    browser = find_browser()
    labels = ["[CLS]", "</script><b id=x>", "a&amp;b", '"q"', "[SEP]"]
    m = np.random.default_rng(0).random((1, 2, 5, 5)).astype(np.float32)  # (L, H, R, R)
    page = write_view(tmp_path / "v.html", labels, [KindMaps("attention", m, [4])])
    assert "</script><b" not in page.read_text().split('id="maps-data">', 1)[1].split("</script>", 1)[0]
    dom = render(browser, page, "layer=5&head=2&mode=matrix", tmp_path / "profile")
    assert not dom.find("b")
    text = [t.strip() for t in dom.text]
    for w in labels:
        assert text.count(w) >= 2, w
    np.testing.assert_allclose(drawn(dom, "rect", 5), m[0, 1], rtol=1e-6)


def test_view_rejects_maps_of_different_sentences(maps, encoder, tmp_path):
    [other] = probes.word_maps(encoder, ["Dogs bark"], device="cpu", overrides=CPU)
    with pytest.raises(ValueError, match="maps of different sentences"):
        probes.view([maps["attention"], other], tmp_path / "v.html")
    with pytest.raises(ValueError, match="each map kind once"):
        probes.view([maps["attention"], maps["attention"]], tmp_path / "v.html")
    assert not (tmp_path / "v.html").exists()


# ----------------------------------------------------------------------------- the command
def page_data(page: Path) -> dict:
    return json.loads(page.read_text().split('id="maps-data">', 1)[1].split("</script>", 1)[0])


def test_console_script_writes_the_page(folder, maps, tmp_path):
    """``probes-view`` as pyproject.toml declares it, run from another folder: the page holds word_maps' maps; a
    relative ``out`` is from the current folder, printed in full."""
    module, func = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["probes-view"].split(":")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", f"from {module} import {func}; {func}()", "encoder=auto",
                          f"encoder.name_or_path={folder}", f"sentence={SENTENCE}", "kinds=[attention,rollout]",
                          "out=page/v.html", "analysis_device=cpu", *CPU],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    page = tmp_path / "page" / "v.html"
    assert out.stdout.strip() == str(page.resolve()) and page.is_file()  # the full path of out=page/v.html
    data = page_data(page)
    assert data["labels"] == maps["attention"].labels and data["title"].endswith(": " + SENTENCE)
    for k, name in zip(data["kinds"], ("attention", "rollout")):
        wm = maps[name]
        assert k["kind"] == name and k["layers"] == [0, 1] and k["heads"] == wm.maps.shape[1]
        np.testing.assert_allclose(np.array(k["values"]).reshape(wm.maps.shape), wm.maps, rtol=1e-6, atol=1e-9)


def test_command_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="conf/view.yaml: sentence is required"):
        run(["encoder=tiny", f"out={tmp_path / 'v.html'}"])
    with pytest.raises(ValueError, match="conf/view.yaml: layers must be"):
        run(["encoder=tiny", "sentence=a b", "layers=[0,one]", f"out={tmp_path / 'v.html'}"])
    with pytest.raises(KeyError, match="no_such_kind"):
        run(["encoder=tiny", "sentence=a b", "kinds=[no_such_kind]", f"out={tmp_path / 'v.html'}"])
    assert not (tmp_path / "v.html").exists()
    out = subprocess.run([sys.executable, "-m", "probes.report.view", "encoder=tiny", "sentence=a b",
                          "kinds=[no_such_kind]", f"out={tmp_path / 'v.html'}"], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("probes-view: error: ") and "no_such_kind" in out.stderr
    assert not (tmp_path / "v.html").exists()
