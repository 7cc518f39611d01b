"""Pinned downloads against a local HTTP server; Treebank from the YAML config."""

import functools
import hashlib
import os
import socket
import subprocess
import sys
import threading
import tomllib
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from probes.data.sources import ChecksumError, Treebank, ensure_file

REPO = Path(__file__).resolve().parents[1]
PAYLOAD = b"1\thello\t_\t_\t_\t_\t0\troot\t_\t_\n\n" * 1000


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "srv"
    root.mkdir()
    (root / "a.conllu").write_bytes(PAYLOAD)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    httpd.timeout = 5
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(timeout=5)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_download_ok(server, tmp_path, caplog):
    dest = tmp_path / "data" / "tb" / "a.conllu"
    sha = hashlib.sha256(PAYLOAD).hexdigest()
    with caplog.at_level("INFO", logger="probes.data.sources"):
        assert ensure_file(dest, f"{server}/a.conllu", sha) == dest
    assert dest.read_bytes() == PAYLOAD
    assert not dest.with_suffix(".conllu.part").exists()
    assert "downloading" in caplog.text
    # present: returned as is, no network needed
    assert ensure_file(dest, f"http://127.0.0.1:{_closed_port()}/x", "0" * 64, download=False) == dest


def test_download_without_pin_logs_digest(server, tmp_path, caplog):
    dest = tmp_path / "a.conllu"
    with caplog.at_level("WARNING", logger="probes.data.sources"):
        ensure_file(dest, f"{server}/a.conllu", None)
    assert hashlib.sha256(PAYLOAD).hexdigest() in caplog.text


def test_wrong_sha(server, tmp_path):
    dest = tmp_path / "dl" / "a.conllu"
    url = f"{server}/a.conllu"
    with pytest.raises(ChecksumError) as ei:
        ensure_file(dest, url, "0" * 64)
    msg = str(ei.value)
    assert url in msg and "0" * 64 in msg and hashlib.sha256(PAYLOAD).hexdigest() in msg
    assert not dest.exists() and not dest.with_suffix(".conllu.part").exists()
    assert list(dest.parent.iterdir()) == []


def test_missing_no_download(tmp_path):
    dest = tmp_path / "tb" / "a.conllu"
    with pytest.raises(FileNotFoundError) as ei:
        ensure_file(dest, "http://example.invalid/a.conllu", None, download=False)
    assert str(dest) in str(ei.value) and "PROBES_DATA_DIR" in str(ei.value)
    with pytest.raises(FileNotFoundError, match="a.conllu"):
        ensure_file(dest, None, None)


def test_unreachable(tmp_path):
    dest = tmp_path / "a.conllu"
    url = f"http://127.0.0.1:{_closed_port()}/x"
    with pytest.raises(FileNotFoundError) as ei:
        ensure_file(dest, url, None)
    assert str(dest) in str(ei.value) and url in str(ei.value)
    assert not dest.exists() and not dest.with_suffix(".conllu.part").exists()


def test_404(server, tmp_path):
    with pytest.raises(FileNotFoundError, match="404"):
        ensure_file(tmp_path / "b.conllu", f"{server}/b.conllu", None)


def test_treebank(server, tmp_path):
    tb = Treebank(name="tb", data_dir=str(tmp_path / "d"), subdir="tb", files={"train": "a.conllu"},
                  urls={"train": f"{server}/a.conllu"}, sha256=None)
    assert tb.path("train") == tmp_path / "d" / "tb" / "a.conllu"
    with pytest.raises(KeyError, match="train"):
        tb.path("dev")
    assert len(tb.read("train")) == 1000
    assert tb.file_sha256("train") == hashlib.sha256(PAYLOAD).hexdigest()
    tb.path("train").write_bytes(b"changed")
    assert tb.file_sha256("train") == hashlib.sha256(PAYLOAD).hexdigest()  # memoised


@pytest.mark.slow
def test_treebank_from_config(shared_data):
    d = shared_data
    cfg = OmegaConf.load(REPO / "conf" / "treebank" / "ewt.yaml")
    cfg.data_dir = str(d)
    tb = instantiate(cfg)
    assert isinstance(tb, Treebank) and tb.name == cfg.name == "ud_english_ewt"
    assert tb.path("test") == d / "ud_english_ewt" / "en_ewt-ud-test.conllu"
    assert len(tb.read("test")) == 2077
    assert tb.file_sha256("test") == cfg.sha256.test
    assert load_treebank("ewt", d).path("test") == tb.path("test")


def load_treebank(name: str, data_dir: Path) -> Treebank:
    """The treebank node of conf/fetch.yaml with ``treebank=<name>``, as the fetch entry point composes it."""
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("fetch", overrides=[f"treebank={name}", f"paths.data_dir={data_dir}"])
    return instantiate(cfg.treebank)


def _console_script(args: list[str], cwd: Path, data_dir: Path | None = None) -> subprocess.CompletedProcess:
    """``probes-fetch <args>`` as pyproject.toml declares it (``module:function``), run by this checkout's
    interpreter from ``cwd`` (not the repository: the config path must not depend on the working folder)."""
    module, func = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["probes-fetch"].split(":")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if data_dir is not None:
        env["PROBES_DATA_DIR"] = str(data_dir)
    return subprocess.run([sys.executable, "-c", f"from {module} import {func}; {func}()", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_console_script_verifies_files_already_there(tmp_path, shared_data):
    """`probes-fetch treebank=ewt` from another folder: prints the pinned files it checked, downloads nothing."""
    before = sorted(p.name for p in (shared_data / "ud_english_ewt").iterdir())
    out = _console_script(["treebank=ewt", f"paths.data_dir={shared_data}"], tmp_path)
    assert out.returncode == 0, out.stderr
    tb = load_treebank("ewt", shared_data)
    assert out.stdout.splitlines() == [f"ud_english_ewt/{s}: {tb.path(s)}" for s in ("train", "dev", "test")]
    assert "downloading" not in out.stderr and list(tmp_path.iterdir()) == []  # no run folder either
    assert sorted(p.name for p in (shared_data / "ud_english_ewt").iterdir()) == before


def test_console_script_names_a_corrupt_file(tmp_path):
    """A data folder whose EWT train file is not the pinned one: a clear sha256 error, the file left as is."""
    data = tmp_path / "data"
    (data / "ud_english_ewt").mkdir(parents=True)
    tb = load_treebank("ewt", data)
    for split in tb.splits:
        tb.path(split).write_bytes(PAYLOAD)
    digest = hashlib.sha256(PAYLOAD).hexdigest()
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    out = _console_script(["treebank=ewt"], run_dir, data_dir=data)  # paths.data_dir from $PROBES_DATA_DIR
    assert out.returncode != 0 and out.stdout == ""
    assert "ChecksumError" in out.stderr and str(tb.path("train")) in out.stderr
    assert digest in out.stderr and tb.sha256["train"] in out.stderr
    assert "treebank.sha256.train" in out.stderr and "conf/treebank/ewt.yaml" in out.stderr
    assert "downloading" not in out.stderr and tb.path("train").read_bytes() == PAYLOAD
    assert sorted(p.name for p in (data / "ud_english_ewt").iterdir()) == sorted(tb.files.values())


@pytest.mark.slow
def test_fetch_entry_point_verifies_shared(tmp_path, shared_data):
    """`python -m probes.data.fetch treebank=gum` checks the pinned sha256 of present files, writes no run folder."""
    d = shared_data
    env = dict(os.environ, PROBES_DATA_DIR=str(d), PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "probes.data.fetch", "treebank=gum"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"ud_english_gum/dev: {d / 'ud_english_gum' / 'en_gum-ud-dev.conllu'}" in out.stdout
    assert list(tmp_path.iterdir()) == []
    bad = subprocess.run([sys.executable, "-m", "probes.data.fetch", "treebank=nope"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "treebank" in bad.stderr and "nope" in bad.stderr


@pytest.mark.slow
def test_config_pins_match_shared(shared_data):
    d = shared_data
    for name, pinned in [("ewt", {"train", "dev", "test"}), ("gum", {"dev", "test"})]:
        tb = load_treebank(name, d)
        assert set(tb.sha256) == pinned and set(tb.urls) == {"train", "dev", "test"}
        for split in pinned:
            assert tb.file_sha256(split) == tb.sha256[split], (name, split)
