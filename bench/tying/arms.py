"""The study's arms: each a shipped config and the overrides that make it that arm, as a dplit command line.

:class:`Study` builds an arm's ``dplit`` command and its fingerprint (:mod:`bench.study.version`: the code version, the
config's digest and the command without this machine's paths), by which a rerun knows the arms already recorded.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.study import sst2
from bench.study.record import ROOT
from bench.study.version import config_digest, fingerprint, portable_command

TIED, UNTIED, LORA = (f"configs/smollm2_sst2_{name}.yaml" for name in ("tied", "untied", "lora"))


@dataclass(frozen=True)
class Arm:
    """One arm of the study: a shipped config and the overrides that make it this arm."""

    label: str
    config: str
    private: bool = True
    trains: bool = True
    lora: bool = False
    overrides: tuple[str, ...] = ()


ARMS: dict[str, Arm] = {
    "zero_shot": Arm("zero-shot", TIED, private=False, trains=False),
    "non_private": Arm("non-private", TIED, private=False),
    "dp_tied": Arm("DP tied", TIED),
    "dp_untied": Arm("DP untied", UNTIED),
    "lora_tied": Arm("DP LoRA + tied emb.", LORA, lora=True),
    "lora_untied": Arm("DP LoRA + untied emb.", LORA, lora=True,
                       overrides=("--model.embeddings", "dplit.embeddings.UntiedEmbeddings")),
    "lora_frozen": Arm("DP LoRA, emb. frozen", LORA, lora=True, overrides=("--model.train_embeddings", "false")),
}
PAIRS = (("full fine-tuning", "dp_untied", "dp_tied"), ("LoRA + trained embedding", "lora_untied", "lora_tied"))
"""The untied − tied comparisons the table pairs by seed: (name, untied arm, tied arm)."""


def model_identity(sources: dict[str, Any]) -> str:
    """The checkpoint, named without this machine's paths: the GGUF file's name, else the hub name or folder."""
    return Path(sources["gguf_source"]).name if sources.get("gguf_source") else str(sources["pretrained"])


def dplit_args(args: argparse.Namespace, sources: dict[str, Any], run: dict[str, Any], log_dir: Path) -> list[str]:
    """The ``dplit`` command line of one arm: its shipped SmolLM2 SST-2 config plus the study's overrides."""
    arm = ARMS[run["arm"]]
    command = ["fit" if arm.trains else "validate", "--config", arm.config, *sst2.source_overrides(sources)]
    callbacks = [{"class_path": "dplit.callbacks.ResourceMonitor"}, {"class_path": "bench.study.step_timer.StepTimer"}]
    lr = run.get("lr") or (args.lora_lr if arm.lora else args.lr)
    command += [
        "--seed_everything", str(run["seed"]),
        "--trainer.accelerator", args.accelerator, "--trainer.devices", "1", "--trainer.precision", args.precision,
        "--trainer.max_epochs", str(args.epochs),
        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.num_sanity_val_steps", "0",
        # validation once, after training (the child calls trainer.validate), so the fit time is training only
        "--trainer.val_check_interval", "1.0", "--trainer.check_val_every_n_epoch", str(10**6),
        "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(log_dir),
        "--trainer.callbacks", json.dumps(callbacks),
        "--model.lr", repr(lr),
        "--data.batch_size", str(args.batch_size), "--data.eval_batch_size", str(args.eval_batch_size),
        "--data.max_length", str(args.max_length), "--data.label_words", json.dumps(sst2.LABEL_WORDS),
        "--data.template", sst2.TEMPLATE, *arm.overrides,
    ]
    if run.get("rows") is not None and arm.trains:
        command += ["--data.max_train_examples", str(run["rows"])]
    if not arm.private:
        return command + ["--trainer.strategy", "auto", "--non_private", "true"]
    prefix = "--trainer.strategy.init_args."
    return command + [
        prefix + "target_epsilon", repr(float(run["epsilon"])), prefix + "max_grad_norm", repr(args.max_grad_norm),
        prefix + "clipping", "ghost", prefix + "max_physical_batch_size", str(args.physical_batch_size),
        *((prefix + "seed", str(run["dp_seed"])) if run.get("dp_seed") is not None else ()),
    ]


class Study:
    """The sources, the held-out slice and the code version one sitting runs its arms with.

    Args:
        args: the study's arguments (:func:`parse_args`).
        sources: where the model, tokenizer and SST-2 come from (``sst2.prepare``).
        holdout: the held-out slice the learning-rate sweep validates on (``None``: no sweep).
        code: the study code version (:func:`study_code_version`).
    """

    def __init__(self, args: argparse.Namespace, sources: dict[str, Any], holdout: dict[str, Any] | None,
                 code: str) -> None:
        self.args, self.sources, self.holdout, self.code = args, sources, holdout, code
        self.configs = {arm.config: config_digest(ROOT / arm.config) for arm in ARMS.values()}
        model = model_identity(sources) if sources.get("gguf_source") else "<model>"  # a folder's path is this machine's
        self.replacements = {str(sources["pretrained"]): model, str(sources["data_dir"]): "<sst2>"}
        if holdout is not None:
            self.replacements[str(holdout["data_dir"])] = "<sst2 held-out>"

    def command(self, run: dict[str, Any], log_dir: Path) -> list[str]:
        """The dplit command line of ``run`` (a sweep run trains clear of the held-out rows and validates on them)."""
        if not run.get("sweep"):
            return dplit_args(self.args, self.sources, run, log_dir)
        assert self.holdout is not None
        rows = sst2.sweep_train_rows(run["rows"], self.holdout, self.args.holdout_rows)
        return dplit_args(self.args, self.holdout, {**run, "rows": rows}, log_dir)

    def fingerprint(self, run: dict[str, Any]) -> str:
        """The fingerprint of ``run``: the code version, its config's digest and its portable command.

        Its log folder and the machine's paths are left out (:mod:`bench.study.version`).
        """
        folder = self.args.logs / run["name"]
        command = portable_command(self.command(run, folder), {**self.replacements, str(folder): "<logs>"})
        return fingerprint(self.code, self.configs[ARMS[run["arm"]].config], command)
