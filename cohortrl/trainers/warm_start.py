"""A supervised warm start trained once per config and reused: what lets ``cohortrl demo`` run GRPO from an
SFT model without paying for the SFT run every time.

``cached_sft(config, root)`` returns the directory of a complete ``cohortrl sft`` run of exactly ``config``
(``config.yaml``, ``metrics.jsonl`` with its held-out evaluations, ``curves.png``, ``final/``), under
``root/KEY``. ``KEY`` is a hash of the config (every field but ``train.progress``, which changes nothing
computed) and the cohortrl version; a code change under the same version is not seen, so ``fresh=True``
trains again.

An entry is used only if it is whole: its ``config.yaml`` hashes to its own key, ``final/`` verifies
against its manifest (every file's size and SHA-256, ``checkpoint.verify``) and was saved at the last step,
and ``metrics.jsonl`` holds that step's evaluation. Anything else (a damaged file, a copy that did not
finish) is trained again, and the reason is returned. A new entry is trained in ``root/.building-KEY``
(under the run directory's lock, so two processes never train the same one; a build killed half way is
started over by the next) and renamed into place only once complete, so ``root/KEY`` is never half
written.
"""

from __future__ import annotations

import gc
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from cohortrl import __version__
from cohortrl.config import Config
from cohortrl.models import final_marker, manifest_sha256
from cohortrl.trainers import checkpoint
from cohortrl.trainers.inputs import as_config
from cohortrl.trainers.loop import config_hashes
from cohortrl.trainers.metrics import read_metrics

# train.* fields left out of the key: they change what is shown or when memory goes back to the OS, not what is computed
COSMETIC = ("progress", "cpu_heap_trim_every")


@dataclass
class WarmStart:
    """A cached SFT run: ``path`` (its run directory), whether this call ``reused`` it, and why an entry that
    was there could not be used (``rejected``, None if there was none or it was used)."""

    path: Path
    reused: bool
    rejected: str | None = None

    @property
    def final(self) -> Path:
        """The run's ``final/``: a ``model.init`` for RL."""
        return self.path / "final"

    def evaluations(self) -> list[dict]:
        """The run's held-out evaluations (rows of ``metrics.jsonl`` with ``eval/accuracy``), in step order."""
        return [r for r in read_metrics(self.path) if "eval/accuracy" in r]


def cache_key(config: dict) -> str:
    """The entry's name for a config (a ``Config.to_dict()`` or its YAML, loaded): 16 hex digits."""
    kept = {**config, "train": {k: v for k, v in config.get("train", {}).items() if k not in COSMETIC}}
    text = json.dumps({"config": kept, "cohortrl": __version__}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def problem(path: Path, cfg: Config) -> str | None:
    """None if ``path`` holds a complete SFT run of ``cfg``, else one line saying what is wrong with it."""
    config = path / "config.yaml"
    if not config.is_file():
        return f"{config}: missing"
    try:
        saved = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError) as e:
        return f"{config}: unreadable ({str(e).splitlines()[0]})"
    if not isinstance(saved, dict) or cache_key(saved) != cache_key(cfg.to_dict()):
        return f"{config}: not this config (another run's, or edited)"
    final = path / "final"
    damage = checkpoint.verify(final, config_hashes(saved))
    if damage is not None:
        return damage
    steps = cfg.train.steps
    marker = final_marker(final)
    if marker["step"] != steps:
        return f"{final}: saved before the last step ({steps})"
    started = (marker.get("init") or {}).get("manifest_sha256")  # an adapter records the weights it was trained on
    if started is not None and started != manifest_sha256(cfg.model.init):
        return f"{final}: trained on {cfg.model.init} as it was before (its manifest has changed since)"
    try:
        evaluated = {r["step"] for r in read_metrics(path) if "eval/accuracy" in r}
    except (OSError, ValueError, KeyError) as e:
        return f"{path / 'metrics.jsonl'}: unreadable ({e})"
    if cfg.eval.n_prompts and steps not in evaluated:
        return f"{path / 'metrics.jsonl'}: no held-out evaluation at step {steps}"
    return None


def lookup(config, root: str | Path) -> tuple[Path, str | None]:
    """Where ``config``'s entry lives under ``root``, and why it cannot be used as it is (None: it can)."""
    cfg = as_config(config)
    path = Path(root) / cache_key(cfg.to_dict())
    return path, (problem(path, cfg) if path.exists() else f"{path}: not there")


def cached_sft(config, root: str | Path, *, fresh: bool = False, callbacks=()) -> WarmStart:
    """The SFT run of ``config`` (a ``Config``, a dict of sections or a YAML path) under ``root``: reused when
    a whole one is there (and not ``fresh``), else trained (``callbacks`` as for ``SFTTrainer``) and put there."""
    from cohortrl.trainers.sft import SFTTrainer

    cfg = as_config(config)
    path, rejected = lookup(cfg, root)
    if not path.exists():
        rejected = None  # nothing was there to reject
    elif fresh:
        rejected = "a new one was asked for (fresh)"
    elif rejected is None:
        return WarmStart(path, reused=True)
    build = path.parent / f".building-{path.name}"
    trainer = SFTTrainer(cfg, build, overwrite=True, callbacks=callbacks)  # refused while another process builds it
    try:
        trainer.train()
    finally:
        trainer.close()
    del trainer
    gc.collect()  # the SFT model's memory, before the caller loads the next one
    built = problem(build, cfg)
    if built is not None:
        raise RuntimeError(f"the warm start trained in {build} is not complete: {built}")
    checkpoint.swap_in(build, path)
    return WarmStart(path, reused=False, rejected=rejected)
