"""``dplit export``: a trained checkpoint as a plain Hugging Face folder, with its model card and guarantee."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from dplit.backbone.adapters import adapter_parameters
from dplit.backbone.embeddings import is_tied
from dplit.data.tasks import get_task
from dplit.privacy.composition import PER_UNIT
from dplit.privacy.export_seal import seal_export
from dplit.release.card import model_card
from dplit.release.checkpoint import check_checkpoint_file
from dplit.release.guarantee import GUARANTEE_FILE
from dplit.release.trained import TrainedModel, load_trained

CLASSIFIER_FILE = "dplit_classifier.json"
HEAD_FILE = "dplit_head.safetensors"


def export_checkpoint(
    ckpt_path: str | Path,
    output_dir: str | Path,
    *,
    config: str | Path | None = None,
    adapter_only: bool = False,
    overwrite: bool = False,
    data_description: str | None = None,
    publish_private_diagnostics: bool = False,
    on_checked: Callable[[], None] | None = None,
) -> Path:
    """Write ``output_dir``: weights, config, generation config, tokenizer, ``README.md`` and ``dp_guarantee.json``.

    Args:
        ckpt_path: a checkpoint of ``dplit fit`` or ``dplit lm fit``.
        output_dir: the folder to write (must not exist, or be empty, or be an earlier export with ``overwrite``).
        config: the run's YAML config, for a checkpoint without dplit's release record.
        adapter_only: write peft's adapter folder (``PeftModel.from_pretrained`` loads it) instead of the merged model.
        overwrite: replace an earlier dplit export in ``output_dir``.
        data_description: what the card says the training data was (default: the file's or folder's base name).
        publish_private_diagnostics: state in the card and ``dp_guarantee.json`` the values the run computed from
            the private data without noise (the largest user's row count), each marked as not covered by ε. Off
            (the default), the released files carry none; the local ledger and TensorBoard are unchanged.
        on_checked: called once the checkpoint and the output folder are checked, before the work (the command
            announces the work there, so a refused input prints only its one line).

    Returns:
        The folder written.

    Raises:
        ValueError: in one line naming the flag, before any work, for a bad checkpoint or output folder.
    """
    check_checkpoint_file(ckpt_path, flag="--ckpt_path")
    target = check_output_dir(output_dir, overwrite=overwrite)
    trained = load_trained(ckpt_path, config=config, publish_private_diagnostics=publish_private_diagnostics)
    if data_description:
        trained.guarantee["data_source"] = data_description
    if adapter_only:
        _check_adapter_only(trained)
    elif trained.hparams.get("quantization"):
        raise ValueError(
            "the run's base is quantised (model.quantization): export its adapters with --adapter_only, and merge "
            "them onto the float base if you need one model (PeftModel.from_pretrained(base, folder).merge_and_unload())"
        )
    if on_checked is not None:
        on_checked()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(_umask_mode(0o777))  # mkdtemp makes it 0700; a model meant for sharing follows the umask
    try:
        _write(trained, staging, adapter_only=adapter_only)
        with _ctrl_c_held():  # the folder is the earlier export or the new one, never half of either
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # an interrupted or failed export leaves no folder behind
    return target


def _umask_mode(mode: int) -> int:
    """``mode`` less the process' umask (what ``mkdir`` would have given)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Ignore Ctrl-C (SIGINT) for the moment the finished export replaces ``--output_dir`` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def check_output_dir(output_dir: str | Path, *, overwrite: bool) -> Path:
    """Refuse an output folder that holds files, unless it is an earlier export and ``overwrite`` is set."""
    target = Path(output_dir).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise ValueError(f"--output_dir {output_dir}: is a file, not a folder")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise ValueError(
                f"--output_dir {output_dir}: exists and is not empty (pass --overwrite to replace an export)"
            )
        if not (target / GUARANTEE_FILE).is_file():
            raise ValueError(
                f"--output_dir {output_dir}: --overwrite replaces only an earlier dplit export (with {GUARANTEE_FILE}), "
                "and this folder is not one: choose a new folder"
            )
    if not target.parent.is_dir():
        raise ValueError(f"--output_dir {output_dir}: its parent folder does not exist")
    return target


def _check_adapter_only(trained: TrainedModel) -> None:
    backbone = trained.module.backbone
    if not adapter_parameters(backbone):
        raise ValueError("--adapter_only: the checkpoint has no peft adapters (model.peft was not set)")
    trained_base = [name for name, p in trained.module.named_parameters() if p.requires_grad and not _is_adapter(name)]
    if trained_base:
        raise ValueError(
            f"--adapter_only: the run also trained {trained_base[0]} (model.train_embeddings or a linear head), "
            "which an adapter folder cannot hold: export the merged model (leave --adapter_only unset)"
        )


def _is_adapter(name: str) -> bool:
    return "lora_" in name or ".adapter" in name or "ia3_l" in name


def _write(trained: TrainedModel, folder: Path, *, adapter_only: bool) -> None:
    backbone = trained.module.backbone
    tokenizer = trained.tokenizer
    if adapter_only:
        _save_adapters(backbone, folder, trained.hparams)
    else:
        merge_adapters(backbone)
        forget_gguf_quantizer(backbone)
        backbone.config.tie_word_embeddings = is_tied(backbone)
        backbone.generation_config.pad_token_id = tokenizer.pad_token_id
        backbone.generation_config.eos_token_id = tokenizer.eos_token_id  # what dplit's training ends each row with
        backbone.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    kind = "causal LM"
    if trained.is_classifier:
        kind = "label-word classifier (a causal LM)" if trained.hparams.get("head") != "linear" else "classifier"
        _save_classifier(trained, folder)
    guarantee = seal_export(folder, trained.guarantee)  # the weight files and the guarantee name each other
    (folder / GUARANTEE_FILE).write_text(json.dumps(guarantee, indent=1, allow_nan=False) + "\n")
    (folder / "README.md").write_text(model_card(guarantee, kind=kind))


def merge_adapters(model: PreTrainedModel) -> None:
    """Fold every peft adapter into its base layer and put the base layer back in its place (in place)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuned = [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]
    for name, module in tuned:
        module.merge(safe_merge=True)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, module.get_base_layer())
    if tuned and hasattr(model, "peft_config"):
        del model.peft_config


def forget_gguf_quantizer(model: PreTrainedModel) -> None:
    """Drop transformers' GGUF marker from a model whose GGUF weights were dequantised on load (saved as float32)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    plain = all(param.dtype.is_floating_point for param in model.parameters())  # dequantised: what dplit trained
    if type(quantizer).__name__ != "GgufHfQuantizer" or not plain:
        raise ValueError(f"the model is quantized ({type(quantizer).__name__}), which dplit does not export")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _save_adapters(model: PreTrainedModel, folder: Path, hparams: dict[str, Any]) -> None:
    """PEFT's adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors`` (adapter ``default``)."""
    from peft import get_peft_model_state_dict

    from dplit.backbone.adapters import adapter_config

    config = adapter_config(hparams["peft"])
    config.base_model_name_or_path = hparams.get("pretrained")
    config.save_pretrained(str(folder))
    weights = get_peft_model_state_dict(model, state_dict=None, adapter_name="default", save_embedding_layers=False)
    weights = {f"base_model.model.{key}": value.detach().contiguous() for key, value in weights.items()}  # PeftModel's
    save_file(weights, str(folder / "adapter_model.safetensors"))


def _save_classifier(trained: TrainedModel, folder: Path) -> None:
    """``dplit_classifier.json`` (how to read a class from the LM), and the linear head's weights when there is one."""
    data, hparams = trained.data_hparams, trained.hparams
    spec = get_task(data.get("task", "sst2"))
    words = data.get("label_words") or spec.label_words
    record = {
        "task": spec.name,
        "head": hparams.get("head", "label_words"),
        "template": data.get("template") or spec.template,
        "text_columns": list(spec.text_columns),
        "labels": list(words),
        "label_words": {str(label): word for label, word in words.items()},
        "label_word_ids": hparams.get("label_word_ids"),
        "max_length": data.get("max_length"),
        "padding_side": data.get("padding_side", "right"),
        "how": "format the template with the text columns, run the causal LM with position_ids = cumsum(attention_mask) "
        "- 1 and read the last real token: the class logits are the LM logits at label_word_ids "
        f"(head 'label_words'), or {HEAD_FILE}'s weight times the last hidden state (head 'linear')",
    }
    if isinstance(trained.module.score, nn.Linear):
        save_file({"weight": trained.module.score.weight.detach().contiguous()}, str(folder / HEAD_FILE))
        record["head_file"] = HEAD_FILE
    (folder / CLASSIFIER_FILE).write_text(json.dumps(record, indent=1) + "\n")


def export_summary(folder: Path, guarantee: dict[str, Any]) -> str:
    """The line the command prints: where the export went and its guarantee."""
    if guarantee["differentially_private"]:
        unit = PER_UNIT.get(guarantee.get("protected_unit", "example"), PER_UNIT["example"])
        epsilon, delta = guarantee["epsilon"], guarantee["delta"]
        return f"exported to {folder}: (ε = {epsilon:.4g}, δ = {delta:.3g})-DP {unit}, see README.md"
    return f"exported to {folder}: NOT differentially private ({guarantee['reason']})"
