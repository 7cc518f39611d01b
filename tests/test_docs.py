"""The docs: the MkDocs site builds with warnings as errors, the README stays a landing page, every
relative link in the README and the pages points to a file that exists, every public module has its entry in
the API reference, and the built index and API reference pages render in headless Chromium with their
headings and API names."""

import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pytest
import yaml

from tests.conftest import ROOT, find_browser

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300

# [text](target) and ![alt](target), the target up to the first space or ')' (an optional "title" after it)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"\s*$', re.M)  # pymdownx.snippets, paths from the repository root


API_PAGE = DOCS / "reference" / "api.md"  # the overview: `probes` and the public API `probes.api`
API_PAGES = DOCS / "reference" / "api"  # one page per package: <pkg>.md; the top-level modules on probes.md
ENTRY = re.compile(r"^::: ([\w.]+)\s*$", re.M)


class _MkDocsLoader(yaml.SafeLoader):
    """mkdocs.yml with MkDocs' own tags (``!relative``, ``!ENV``, ``!!python/name:``) read as None: only the nav
    is needed here."""


_MkDocsLoader.add_multi_constructor("!", lambda loader, suffix, node: None)
_MkDocsLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file (no scheme, not a bare #anchor), anchors dropped."""
    out = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def public_modules() -> list[str]:
    """Every module of the package whose name does not start with ``_`` (packages by their ``__init__.py``)."""
    out = []
    for path in (ROOT / "probes").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts):
            out.append(".".join(parts))
    return sorted(out)


def api_page(module: str) -> Path:
    """The reference page that documents ``module``: the overview for ``probes`` and ``probes.api``, the page
    of its top-level package, or ``probes.md`` for the other top-level modules."""
    if module in ("probes", "probes.api"):
        return API_PAGE
    top = module.split(".")[1]
    return API_PAGES / (f"{top}.md" if (ROOT / "probes" / top).is_dir() else "probes.md")


def api_entries() -> dict[str, list[Path]]:
    """``::: name`` entries of the reference pages: name -> the pages that hold it."""
    out: dict[str, list[Path]] = {}
    for page in [API_PAGE, *sorted(API_PAGES.glob("*.md"))]:
        for name in ENTRY.findall(page.read_text()):
            out.setdefault(name, []).append(page)
    return out


def test_every_public_module_has_an_api_entry():
    mods, entries = public_modules(), api_entries()
    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731
    errors = [f"add `::: {m}` to {rel(api_page(m))}" + ("" if api_page(m).is_file() else
              " (a new page: add it to the nav of mkdocs.yml under Reference > API)")
              for m in mods if m not in entries]
    errors += [f"`::: {m}` in {', '.join(map(str, map(rel, pages)))}: no such module" for m, pages in entries.items()
               if m not in mods]
    errors += [f"`::: {m}` is on {', '.join(map(str, map(rel, pages)))}; once, on {rel(api_page(m))}"
               for m, pages in entries.items() if m in mods and pages != [api_page(m)]]
    assert not errors, "the API reference does not match the package:\n" + "\n".join(errors)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """`mkdocs build --strict` of this checkout into a temp folder; any warning fails the build."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                        str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{log[-4000:]}"
    warnings = [ln for ln in log.splitlines() if re.match(r"^\s*(WARNING|ERROR)\b", ln)]
    assert not warnings, "\n".join(warnings)
    return out


def test_site_builds_strict(site):
    for page in ("index.html", "getting-started/index.html", "reference/api/index.html",
                 "papers/clark/index.html", "howto/treebank/index.html"):
        assert (site / page).is_file(), page
    # mkdocstrings rendered every module's entry, and objects from their docstrings, on the module's page
    def built(page: Path) -> Path:  # docs/reference/api/model.md -> <site>/reference/api/model/index.html
        return site / page.relative_to(DOCS).with_suffix("") / "index.html"

    for name, pages in api_entries().items():
        assert f'id="{name}"' in built(pages[0]).read_text(), (name, pages[0])
    for name in ("probes.config.compose", "probes.analysis.context.AnalysisContext", "probes.model.load.load_encoder",
                 "probes.measures.Measure", "probes.api.word_maps"):
        page = api_page(name.rpartition(".")[0])
        assert f'id="{name}"' in built(page).read_text(), (name, page)
    # the docstrings' Sphinx roles (:func:`x`) are links to the entries (docs/reference/griffe_roles.py), never raw
    ref = [p.read_text() for p in (site / "reference" / "api").rglob("index.html")]
    raw = sorted({m for text in ref for m in re.findall(r":(?:func|class|mod|meth|attr|data|exc):<code>[^<]*", text)})
    assert not raw, raw[:10]
    assert sum(text.count('class="autorefs autorefs-internal"') for text in ref) > 100
    # the figures the pages show are in the site, at the same place relative to the page's source
    for page in _pages():
        for target in relative_links(page):
            if target.endswith(".png"):
                assert (site / page.relative_to(DOCS).parent / target).resolve().is_file(), (page, target)


def test_readme_is_a_landing_page():
    text = README.read_text()
    n = len(text.splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; at most {MAX_README_LINES} (move details to docs/)"
    # the quick start comes before the main job, and the commands CI and users run are there as they are
    assert text.index("python train.py experiment=smoke") < text.index("python train.py -m 'experiment=glob(table3_*)'")
    assert "pip install --no-compile torch==2.13.0 -e \".[dev]\"" in text
    assert "PROBES_DATA_DIR=../shared/data WANDB_MODE=offline python -m pytest -q" in text
    assert "mkdocs serve" in text


def test_every_nav_page_exists_and_every_page_is_in_nav():
    cfg = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_MkDocsLoader)

    def walk(node):
        for item in node:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from walk(value) if isinstance(value, list) else [value]

    nav = set(walk(cfg["nav"]))
    assert all((DOCS / p).is_file() for p in nav), sorted(p for p in nav if not (DOCS / p).is_file())
    assert nav == {str(p.relative_to(DOCS)) for p in _pages()}


@pytest.mark.parametrize("path", [README, *_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(path):
    missing = [t for t in relative_links(path) if not (path.parent / t).exists()]
    missing += [s for s in SNIPPET.findall(path.read_text()) if not (ROOT / s).is_file()]
    assert not missing, f"{path.relative_to(ROOT)}: links to missing files {missing}"


def test_link_check_sees_a_broken_link(tmp_path):
    """The checker itself: a link to a missing file is found, code spans and URLs are not links."""
    md = tmp_path / "page.md"
    md.write_text("[ok](page.md) ![fig](figures/none.png) `[not](a-link.md)` [web](https://x.org/y.md) [a](#top)\n"
                  "```\n[code](block.md)\n```\n")
    assert relative_links(md) == ["page.md", "figures/none.png"]


@pytest.mark.parametrize("page, heading, names", [
    ("index.html", "Where to start", ["Getting started", "Clark et al. 2019"]),
    ("reference/api/index.html", "API reference", ["probes.api", "load_encoder", "word_maps", "analyze"]),
    ("reference/api/model/index.html", "probes.model", ["probes.model.load", "load_encoder", "encode_words"]),
])
def test_site_renders_in_chromium(site, tmp_path, page, heading, names):
    browser = find_browser()
    url = (site / page).as_uri()
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars"]
    png = tmp_path / "page.png"
    shot = subprocess.run(base + [f"--screenshot={png}", "--window-size=1280,1200", url],
                          capture_output=True, text=True, timeout=180)
    assert png.exists(), shot.stderr[-2000:]
    img = mpimg.imread(png)  # (H, W, 3|4) floats in [0, 1]
    assert img.shape[:2] == (1200, 1280)
    rgb = img[..., :3]
    dark = (rgb.mean(-1) < 0.5).mean()  # text, the header bar
    assert 0.005 < dark < 0.9 and rgb.std() > 0.05, f"{page} looks blank (dark share {dark:.4f}, std {rgb.std():.4f})"
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=180)
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom.stdout))
    assert heading in text, f"{page}: heading {heading!r} not in the rendered page"
    for name in names:
        assert name in text, f"{page}: {name!r} not in the rendered page"
