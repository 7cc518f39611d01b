"""Shared fixtures: real conf/ composition, a synthetic treebank, the shared data folder."""

from __future__ import annotations

import os
import random
import shutil
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
# Three sentences of "EWT dev" shape: determiners, a possessive, punctuation, a one-word sentence.
TINY_CONLLU = """\
# sent_id = s1
1\tThe\tthe\tDET\t_\t_\t2\tdet\t_\t_
2\tdog\tdog\tNOUN\t_\t_\t3\tnsubj\t_\t_
3\tbarked\tbark\tVERB\t_\t_\t0\troot\t_\t_
4\t.\t.\tPUNCT\t_\t_\t3\tpunct\t_\t_

# sent_id = s2
1\tJohn\tJohn\tPROPN\t_\t_\t3\tnmod:poss\t_\t_
2\t's\t's\tPART\t_\t_\t1\tcase\t_\t_
3\tcat\tcat\tNOUN\t_\t_\t4\tnsubj\t_\t_
4\tsat\tsit\tVERB\t_\t_\t0\troot\t_\t_
5\ton\ton\tADP\t_\t_\t7\tcase\t_\t_
6\tthe\tthe\tDET\t_\t_\t7\tdet\t_\t_
7\tunbelievably-comfortable\tmat\tNOUN\t_\t_\t4\tobl\t_\t_
8\t!\t!\tPUNCT\t_\t_\t4\tpunct\t_\t_

# sent_id = s3
1\tHello\thello\tINTJ\t_\t_\t0\troot\t_\t_

"""
WORDS = "the a cat dog saw liked house runs quickly big small red and of to in".split()


TRUE = ("1", "true", "yes", "on")
# the folders of the shared data that tests read through require_shared
SHARED_FOLDERS = ("ud_english_ewt", "ud_english_gum", "glove", "glue", "gum_coref_ontogum", "litbank_coref",
               "attention_patterns")


def shared_data_dir() -> Path:
    """The shared data folder: ``PROBES_DATA_DIR``, else ``<repo>/../shared/data``."""
    return Path(os.environ.get("PROBES_DATA_DIR") or ROOT.parent / "shared" / "data").resolve()


def shared_data_required() -> bool:
    """True in CI (``CI`` set to a true value, as CI runners do) or with ``PROBES_REQUIRE_DATA=1``: a test on
    the shared data then fails when the data is missing instead of skipping."""
    return any(os.environ.get(v, "").strip().lower() in TRUE for v in ("CI", "PROBES_REQUIRE_DATA"))


def require_shared(rel: str = "ud_english_ewt", what: str = "shared data") -> Path:
    """``<shared data>/<rel>`` (a file or folder); when it is missing the calling test fails in CI / with
    ``PROBES_REQUIRE_DATA=1`` and is skipped otherwise, naming the path and ``PROBES_DATA_DIR``."""
    p = shared_data_dir() / rel
    if not p.exists():
        why = (f"{what} not found at {p} (PROBES_DATA_DIR={os.environ.get('PROBES_DATA_DIR', '<unset>')}: "
               f"set it to the shared data folder)")
        if shared_data_required():
            pytest.fail(f"{why}; required because CI or PROBES_REQUIRE_DATA is set", pytrace=False)
        pytest.skip(why)
    return p


def pytest_configure(config: pytest.Config) -> None:
    """Bytecode is cached: with ``PYTHONDONTWRITEBYTECODE`` set (as on the project's machines, CI's too; the install
    runs ``--no-compile``) every test's child interpreter (``python train.py``, ...) and every pytest-xdist worker
    would compile torch, Lightning and transformers from source again (seconds of CPU each); they inherit this
    process's environment, so the variable is removed here, and this process writes what it imports from now on. In a pytest-xdist worker (``-n N``): torch and the child processes it starts use the
    worker's share of the CPUs (``OMP_NUM_THREADS``, read when torch is imported), so that N workers do not each
    start a thread per CPU; a value already set is kept."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers:
        share = str(max(1, len(os.sched_getaffinity(0)) // workers))
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, share)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-xdist's ``--dist loadgroup`` (.ci/run) sends the tests of one group to one worker: a test without an
    ``xdist_group`` mark is in its file's group, so that module-scoped fixtures are built once; a test marked with
    a group of its own (``smollm2_gguf``: tests/reference.py ``gguf_reader``) shares that group's worker."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Where the shared data is required (:func:`shared_data_required`), stop before any test when a folder of
    :data:`SHARED_FOLDERS` is missing, naming it and ``PROBES_DATA_DIR``."""
    if not shared_data_required():
        return
    root = shared_data_dir()
    missing = [name for name in SHARED_FOLDERS if not (root / name).is_dir()]
    if missing:
        pytest.exit(f"the shared data is required (CI or PROBES_REQUIRE_DATA is set) but {', '.join(missing)} "
                    f"not found under {root} (PROBES_DATA_DIR={os.environ.get('PROBES_DATA_DIR', '<unset>')}: "
                    f"set it to the shared data folder)", returncode=1)


@pytest.fixture
def shared_data() -> Path:
    """The shared data folder, holding at least UD EWT (:func:`require_shared`)."""
    return require_shared("ud_english_ewt").parent


def write_chain_treebank(path: Path, n_sentences: int, seed: int = 0) -> None:
    """Sentences whose gold head of word j (1-based) is word j - 1; word 1 is the root; '.' at the end."""
    rng = random.Random(seed)
    lines = []
    for s in range(n_sentences):
        n = rng.randint(3, 10)
        words = [rng.choice(WORDS) for _ in range(n - 1)] + ["."]
        lines.append(f"# sent_id = s{s}")
        for j, w in enumerate(words, start=1):
            upos = "PUNCT" if w == "." else "X"
            lines.append(f"{j}\t{w}\t{w}\t{upos}\t_\t_\t{j - 1}\t{'root' if j == 1 else 'dep'}\t_\t_")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def write_chain_splits(root: Path, sizes=(120, 30, 30), writer=write_chain_treebank) -> Path:
    """`<root>/data/chain/chain-{train,dev,test}.conllu` of ``sizes`` sentences (seeds 0, 1, 2); returns `<root>/data`."""
    d = root / "data" / "chain"
    d.mkdir(parents=True)
    for split, n, seed in zip(("train", "dev", "test"), sizes, (0, 1, 2)):
        writer(d / f"chain-{split}.conllu", n, seed)
    return root / "data"


@pytest.fixture
def chain_data(tmp_path) -> Path:
    """A tiny treebank folder `chain/` with train/dev/test files."""
    return write_chain_splits(tmp_path)


def chain_overrides(data_dir: Path, tmp_path: Path) -> list[str]:
    """Overrides that point `data=ewt` at the synthetic chain treebank and keep everything in tmp_path. The caches
    are built in the training process (``data.extract_in_child=false``): the default child interpreter costs
    seconds of imports per run; the tests of the child itself ask for it (tests/test_extract.py,
    test_extract_child.py, test_progress.py, and one family each in test_families.py and test_decoders.py)."""
    return [
        "encoder=tiny", "logger=none", f"paths.data_dir={data_dir}", f"paths.cache_dir={tmp_path / 'cache'}",
        f"paths.output_dir={tmp_path / 'out'}", "data.name=chain", "data.treebank.name=chain",
        "data.treebank.subdir=chain", "data.treebank.urls=null", "data.treebank.sha256=null",
        "data.treebank.download=false",
        "data.treebank.files={train: chain-train.conllu, dev: chain-dev.conllu, test: chain-test.conllu}",
        "extract.precision=32-true", "extract.trainer.accelerator=cpu", "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "data.extract_in_child=false",
    ]


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def find_browser() -> str:
    """The headless browser on PATH; without one the test fails when ``PROBES_REQUIRE_BROWSER=1`` (CI), else
    it is skipped with the reason."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    why = "apt-get is not available on this machine" if not shutil.which("apt-get") else \
        "install the Debian package `chromium` (.ci/run does)"
    if os.environ.get("PROBES_REQUIRE_BROWSER") == "1":
        pytest.fail(f"PROBES_REQUIRE_BROWSER=1 but no chromium on PATH ({why})")
    pytest.skip(f"no headless browser: chromium not installed ({why})")


def require_model(name: str) -> Path:
    """The file of the real model ``name`` fetched by ``probes-fetch model=<name>`` (into ``paths.models_dir`` of
    the real conf/); when it is missing the calling test fails in CI / with ``PROBES_REQUIRE_DATA=1`` (.ci/run
    fetches what the tests read) and is skipped otherwise, naming the command."""
    from probes.model.fetched import ModelNotFetched, fetched_path
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        models_dir = compose(config_name="analyze").paths.models_dir
    try:
        return fetched_path(name, models_dir)
    except ModelNotFetched as e:
        if shared_data_required():
            pytest.fail(f"{e}; required because CI or PROBES_REQUIRE_DATA is set", pytrace=False)
        pytest.skip(str(e))
