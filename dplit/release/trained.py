"""A dplit checkpoint read back for release: the LightningModule, its tokenizer and its privacy guarantee."""

from __future__ import annotations

import importlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.utilities import rank_zero_info
from transformers import CONFIG_MAPPING, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from dplit.backbone.embeddings import EmbeddingPolicy
from dplit.backbone.quantization import add_quantized_weights
from dplit.privacy.history import history_in_checkpoint
from dplit.release.checkpoint import read_checkpoint
from dplit.release.guarantee import guarantee_of, quantization_summary
from dplit.tasks.base import BACKBONE_KEY, TOKENIZER_KEY, CausalLMModule
from dplit.tasks.provenance import RELEASE_KEY

MODULES = {
    "classifier": "dplit.tasks.classifier.CausalLMClassifier",
    "lm": "dplit.tasks.language_model.CausalLanguageModel",
}
DATAMODULES = {"classifier": "dplit.data.glue.GlueDataModule", "lm": "dplit.data.text.TextDataModule"}


@dataclass
class TrainedModel:
    """A trained dplit module (eval mode, float32), its tokenizer and the guarantee of its checkpoint."""

    module: CausalLMModule
    tokenizer: PreTrainedTokenizerBase
    guarantee: dict[str, Any]
    hparams: dict[str, Any]
    data_hparams: dict[str, Any]

    @property
    def is_classifier(self) -> bool:
        """Whether the module classifies (label words or a linear head) rather than generates."""
        return "head" in self.hparams


def load_trained(
    ckpt_path: str | Path,
    *,
    config: str | Path | None = None,
    flag: str = "--ckpt_path",
    publish_private_diagnostics: bool = False,
) -> TrainedModel:
    """Rebuild the module of a dplit checkpoint from its hyperparameters and load its weights (nothing is trained).

    A checkpoint that carries its backbone's config and tokenizer (dplit writes both) needs nothing else: the
    backbone is built from the config (random weights, never the base model's) and takes the checkpoint's weights.
    An older checkpoint is rebuilt as it was trained, from ``model.pretrained`` and ``data.tokenizer``.

    Args:
        ckpt_path: a checkpoint written by ``dplit fit`` or ``dplit lm fit``.
        config: the run's YAML config, for a checkpoint without dplit's release record (its ``model.embeddings``).
        flag: the command-line flag named in errors.
        publish_private_diagnostics: let the guarantee state the run's private diagnostics (see
            :func:`~dplit.release.guarantee.guarantee_of`); off, it states none.

    Raises:
        ValueError: in one line naming ``flag`` for a missing file or one that is not a dplit checkpoint, or naming
            ``--config`` for a config that is missing, unreadable or for the other kind of model.
    """
    checkpoint = read_checkpoint(ckpt_path, flag=flag)
    if config is not None:
        check_run_config(config, _kind(checkpoint["hyper_parameters"]))
    record = checkpoint.get(RELEASE_KEY) or _record_from_config(ckpt_path, config, checkpoint, flag)
    hparams = dict(checkpoint["hyper_parameters"])
    data_hparams = dict(checkpoint.get("datamodule_hyper_parameters") or {})
    module = _rebuilt(_imported(record["module"]), hparams, _policy(record["embeddings"]), checkpoint.get(BACKBONE_KEY))
    add_quantized_weights(module, checkpoint["state_dict"])  # a quantised base's: reloaded, never saved
    module.load_state_dict(checkpoint["state_dict"], strict=True)
    module.privacy_history = history_in_checkpoint(checkpoint)
    if TOKENIZER_KEY in checkpoint:
        tokenizer = saved_tokenizer(checkpoint[TOKENIZER_KEY], data_hparams, source=f"{flag} {ckpt_path}")
    else:
        datamodule_class = _imported(record.get("datamodule") or DATAMODULES[_kind(hparams)])
        tokenizer = datamodule_class.tokenizer_for(data_hparams)
    guarantee = guarantee_of(checkpoint, publish_private_diagnostics=publish_private_diagnostics)
    return TrainedModel(module.eval(), tokenizer, guarantee, hparams, data_hparams)


def _rebuilt(
    module_class: type[CausalLMModule],
    hparams: dict[str, Any],
    policy: EmbeddingPolicy,
    backbone_config: dict[str, Any] | None,
) -> CausalLMModule:
    """The module of a checkpoint, built by its constructor before the checkpoint's weights are loaded into it.

    With the checkpoint's ``backbone_config`` the backbone is built from that config (``from_config``, as for
    ``model.config``) instead of ``model.pretrained``/``model.gguf_file``; the embedding policy, adapters and head
    are the run's. Without it (a checkpoint of an older dplit), the base model is loaded again, as in training.
    """
    accepted = module_class.argument_names()  # a task's own and, through **kwargs, CausalLMModule's
    arguments = {key: value for key, value in hparams.items() if key in accepted}  # not LightningCLI's _instantiator
    if arguments.get("quantization"):
        rank_zero_info(
            f"the checkpoint's base is quantised and was not saved in it: loading model.pretrained="
            f"{arguments['pretrained']!r} again ({quantization_summary(arguments['quantization'])})"
        )
    elif backbone_config is not None:
        arguments.update(pretrained=None, gguf_file=None, config=config_arguments(backbone_config), vocab_size=None)
    elif arguments.get("pretrained") is not None:
        rank_zero_info(
            f"the checkpoint holds no backbone config (written by an older dplit): loading its base model "
            f"model.pretrained={arguments['pretrained']!r} again to rebuild it"
        )
    module = module_class(**arguments, embeddings=policy)
    if backbone_config is not None:
        restore_metadata(module.backbone.config, backbone_config)
    return module


NOT_ARCHITECTURE = ("transformers_version", "quantization_config")
"""Saved config entries that describe where the weights came from, not the model: left out when rebuilding (a GGUF
base's ``quantization_config`` included: dplit trained and saved its dequantised weights)."""


def config_arguments(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's backbone config as ``model.config`` keyword arguments: the fields its family's config declares.

    Private entries (``_name_or_path``), :data:`NOT_ARCHITECTURE` and keys the family's config class does not
    declare (metadata a hub or GGUF config carried, which the family's model never reads) are left out.
    """
    family = CONFIG_MAPPING[saved["model_type"]] if saved.get("model_type") in CONFIG_MAPPING else None
    declared = set(family().to_dict()) if family is not None else set(saved)
    return {
        key: value
        for key, value in saved.items()
        if key in declared and not key.startswith("_") and key not in NOT_ARCHITECTURE
    }


def restore_metadata(config: PretrainedConfig, saved: dict[str, Any]) -> None:
    """Put back the saved entries :func:`config_arguments` left out, such as a hub or GGUF config's ``unk_token_id``.

    The exported ``config.json`` is the one the base model gave, less :data:`NOT_ARCHITECTURE`.
    """
    present = config.to_dict()
    for key, value in saved.items():
        if key not in present and key not in NOT_ARCHITECTURE:
            setattr(config, key, value)


def saved_tokenizer(files: dict[str, bytes], data_hparams: dict[str, Any], *, source: str) -> PreTrainedTokenizerBase:
    """The tokenizer a checkpoint carries (its ``save_pretrained`` files), padding on the data's side.

    Raises:
        ValueError: naming ``source`` for a file name that is not a plain name (it would be written elsewhere).
    """
    with tempfile.TemporaryDirectory(prefix="dplit-tokenizer-") as folder:
        for name, content in files.items():
            if not isinstance(content, bytes) or Path(name).name != name or name in ("", ".", ".."):
                raise ValueError(f"{source}: its tokenizer entry holds {name!r}, which is not a tokenizer file")
            (Path(folder) / name).write_bytes(content)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = data_hparams.get("padding_side", "right")
    return tokenizer


def _record_from_config(
    ckpt_path: str | Path, config: str | Path | None, checkpoint: dict[str, Any], flag: str
) -> dict[str, Any]:
    """The release record of a checkpoint written before dplit kept one, from the run's config.yaml."""
    if config is None:
        beside = Path(ckpt_path).expanduser().resolve().parent.parent / "config.yaml"  # version_N/checkpoints/x.ckpt
        if not beside.is_file():
            raise ValueError(
                f"{flag} {ckpt_path}: the checkpoint has no dplit release record and no config.yaml beside its "
                "checkpoints/ folder: give the run's config with --config"
            )
        config = beside
    run = _read_config(config)
    kind = _kind(checkpoint["hyper_parameters"])
    embeddings = (run.get("model") or {}).get("embeddings") or {
        "class_path": "dplit.backbone.embeddings.UntiedEmbeddings"
    }
    if isinstance(embeddings, str):
        embeddings = {"class_path": embeddings}
    return {"module": MODULES[kind], "datamodule": DATAMODULES[kind], "embeddings": embeddings}


def check_run_config(config: str | Path, kind: str) -> None:
    """Refuse a ``--config`` that does not exist, is not YAML, or configures the other kind of model than ``kind``."""
    run = _read_config(config)
    model, data = run.get("model") or {}, run.get("data") or {}
    if not isinstance(model, dict) or not isinstance(data, dict):
        raise ValueError(f"--config {config}: not a dplit run config (no model and data sections)")
    classifier = "task" in data or "head" in model
    text = "loss_reduction" in model or any(key in data for key in _TEXT_DATA_KEYS)
    configured = "classifier" if classifier and not text else "lm" if text and not classifier else None
    if configured is not None and configured != kind:
        raise ValueError(
            f"--config {config}: configures a {_COMMANDS[configured]} run, but the checkpoint was trained by "
            f"{_COMMANDS[kind]}: give that run's own config (its config.yaml)"
        )


_TEXT_DATA_KEYS = ("train_file", "dataset", "prompt_column", "response_column", "builtin_train_size", "overlength")
_COMMANDS = {"classifier": "`dplit fit` (classifier)", "lm": "`dplit lm fit` (text generation)"}


def _read_config(config: str | Path) -> dict[str, Any]:
    path = Path(config).expanduser()
    if not path.is_file():
        raise ValueError(f"--config {config}: no such file")
    try:
        run = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"--config {config}: cannot be read as YAML ({type(error).__name__})") from None
    if not isinstance(run, dict):
        raise ValueError(f"--config {config}: not a dplit run config (not a YAML mapping)")
    return run


def _kind(hparams: dict[str, Any]) -> str:
    return "classifier" if "head" in hparams else "lm"


def _policy(record: dict[str, Any]) -> EmbeddingPolicy:
    policy_class = _imported(record["class_path"])
    if not (isinstance(policy_class, type) and issubclass(policy_class, EmbeddingPolicy)):
        raise ValueError(f"model.embeddings: {record['class_path']!r} is not an EmbeddingPolicy")
    return policy_class(**(record.get("init_args") or {}))


def _imported(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    if not module.startswith("dplit."):
        raise ValueError(f"{class_path!r} is not a dplit class: the checkpoint was not written by dplit")
    return getattr(importlib.import_module(module), name)
