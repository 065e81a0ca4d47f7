"""A catalogue of bad inputs a new user gives ``dplit``: each is refused in ONE line, exit 2.

Every row must end with exit code 2, no traceback, exactly one ``dplit: error:`` line (the last on stderr) naming
the culprit, and no checkpoint or ledger written. Rows run inside the test process through the console script's
function (:func:`tests.helpers.executable.run_dplit_in_process`, which puts back what a run changes); a few also run the
real ``dplit`` executable in a subprocess (:data:`END_TO_END`, marked slow), and the rows that depend on what only
a fresh process reads run only there (:data:`EXECUTABLE_ONLY`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from transformers import GPT2Config, GPT2LMHeadModel

from dplit.data.tokenizer import load_tokenizer
from dplit.strategy import DPStrategy
from tests.helpers.commands import CONFIGS, TINY, checkpoint_of, dpo_args, lm_args, lora_on, quickstart_args, steps
from tests.helpers.executable import dplit_executable, run_dplit_in_process, user_environment
from tests.helpers.fitting import make_model
from tests.helpers.glue_files import SST2_HEADER, SST2_ROWS, write_glue_task
from tests.helpers.tiny import RandomTokenData

Setup = Callable[[Path, Path, Path], list[str]]
"""Builds one bad run's command line after ``dplit`` from (a scratch folder, the tiny BPE tokenizer, the run folder)."""

PARALLEL_RUNS = 3
"""Executable rows run at once (each is a fresh Python process that imports torch and Lightning)."""


def flags(*extra: str) -> Setup:
    """``dplit fit`` on the quickstart config, plus ``extra``."""
    return lambda scratch, tokenizer, run: ["fit", *quickstart_args(run), *extra]


def lm_flags(*extra: str) -> Setup:
    """``dplit lm fit`` on the LM quickstart config, plus ``extra``."""
    return lambda scratch, tokenizer, run: ["lm", "fit", *lm_args(run), *extra]




def lm_hub_dataset(name: str) -> Setup:
    """``dplit lm fit`` on the hub dataset ``name`` (offline: see :data:`ROW_ENVIRONMENTS`), the tiny BPE tokenizer."""
    return lambda scratch, tokenizer, run: ["lm", "fit", *lm_args(run, "--data.dataset", name, "--data.tokenizer", str(tokenizer))]


def dpo_flags(*extra: str) -> Setup:
    """``dplit dpo fit`` on the DPO quickstart config, plus ``extra``."""
    return lambda scratch, tokenizer, run: ["dpo", "fit", *dpo_args(run), *extra]


GOOD_PAIR = '{"prompt": "Review:", "chosen": "It was great.", "rejected": "It was bad."}\n'


def dpo_files(name: str, train: str, *extra: str) -> Setup:
    """``dplit dpo fit`` with scratch/``name`` = ``train``, a one-pair val.jsonl and the tiny BPE tokenizer."""

    def setup(scratch: Path, tokenizer: Path, run: Path) -> list[str]:
        (scratch / name).write_text(train)
        (scratch / "val.jsonl").write_text(GOOD_PAIR)
        files = ["--data.tokenizer", str(tokenizer), "--data.train_file", str(scratch / name),
                 "--data.val_file", str(scratch / "val.jsonl")]
        return ["dpo", "fit", *dpo_args(run), *files, *extra]

    return setup


def dpo_hub(splits: dict[str, str], *extra: str) -> Setup:
    """``dplit dpo fit`` on a hub dataset given as a local dataset folder (scratch/prefs, one JSONL file a split)."""

    def setup(scratch: Path, tokenizer: Path, run: Path) -> list[str]:
        (scratch / "prefs").mkdir()
        for split, text in splits.items():
            (scratch / "prefs" / f"{split}.jsonl").write_text(text)
        hub = ["--data.dataset", str(scratch / "prefs"), "--data.tokenizer", str(tokenizer)]
        return ["dpo", "fit", *dpo_args(run), *hub, *extra]

    return setup


def dpo_hub_dataset(name: str) -> Setup:
    """``dplit dpo fit`` on the hub dataset ``name`` (offline: see :data:`ROW_ENVIRONMENTS`), the tiny BPE tokenizer."""
    return lambda scratch, tokenizer, run: ["dpo", "fit", *dpo_args(run), "--data.dataset", name, "--data.tokenizer", str(tokenizer)]


def auditing(*extra: str) -> Setup:
    """``dplit audit`` on the quickstart config, plus ``extra``."""
    return lambda scratch, tokenizer, run: ["audit", *quickstart_args(run), *extra]




def with_files(setup: Callable[[Path, Path], list[str]]) -> Setup:
    """A classifier row whose extra flags need files written into the scratch folder."""
    return lambda scratch, tokenizer, run: ["fit", *quickstart_args(run), *setup(scratch, tokenizer)]


def text_checkpoint(scratch: Path, tokenizer: Path) -> list[str]:
    (scratch / "notes.ckpt").write_text("not a checkpoint\n")
    return ["--ckpt_path", str(scratch / "notes.ckpt")]


def random_bytes_checkpoint(scratch: Path, tokenizer: Path) -> list[str]:
    (scratch / "noise.ckpt").write_bytes(os.urandom(4096))
    return ["--ckpt_path", str(scratch / "noise.ckpt")]


def truncated_checkpoint(scratch: Path, tokenizer: Path) -> list[str]:
    """The first half of a checkpoint file (a copy or a save that did not finish)."""
    torch.save({"state_dict": {"layer.weight": torch.zeros(64, 64)}}, scratch / "whole.ckpt")
    data = (scratch / "whole.ckpt").read_bytes()
    (scratch / "cut.ckpt").write_bytes(data[: len(data) // 2])
    return ["--ckpt_path", str(scratch / "cut.ckpt")]


def object_checkpoint(scratch: Path, tokenizer: Path) -> list[str]:
    """A file torch.save wrote, holding an arbitrary Python object (no checkpoint: weights_only refuses it)."""
    torch.save({"a": object()}, scratch / "object.ckpt")
    return ["--ckpt_path", str(scratch / "object.ckpt")]


def gguf_file_as_pretrained(scratch: Path, tokenizer: Path) -> list[str]:
    """A GGUF file given as ``model.pretrained`` (its folder and ``model.gguf_file`` are what load it)."""
    (scratch / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    return ["--model.config", "null", "--model.pretrained", str(scratch / "model.gguf")]


def lora_rank_4_checkpoint(scratch: Path, tokenizer: Path) -> list[str]:
    """A checkpoint of a rank-4 LoRA run, resumed with ``r: 8`` (the checkpoint's rank would silently win)."""
    torch.save({"state_dict": {}, "hyper_parameters": {"peft": json.loads(lora_on("c_attn"))}}, scratch / "lora.ckpt")
    return ["--model.peft", lora_on("c_attn").replace('"r": 4', '"r": 8'), "--ckpt_path", str(scratch / "lora.ckpt")]


def resumed_after(*first: str) -> Setup:
    """``dplit fit`` on the quickstart config, resuming a one-step quickstart run that had the flags ``first``."""

    def setup(scratch: Path, tokenizer: Path, run: Path) -> list[str]:
        done = run_dplit_in_process("fit", *quickstart_args(scratch / "first", *steps(1), *first))
        assert done.returncode == 0, done.stderr[-3000:]
        return ["fit", *quickstart_args(run), "--ckpt_path", str(checkpoint_of(scratch / "first"))]

    return setup


def second_config(text: str) -> Setup:
    """``dplit fit`` on the quickstart config, then a second ``--config`` file holding ``text``."""

    def setup(scratch: Path, tokenizer: Path, run: Path) -> list[str]:
        (scratch / "extra.yaml").write_text(text)
        return ["fit", *quickstart_args(run), "--config", str(scratch / "extra.yaml")]

    return setup


def sst2_files(train: str | bytes | None, dev: str) -> Callable[[Path, Path], list[str]]:
    """SST-2 run on a tiny random GPT-2 with the given train.tsv / dev.tsv contents (None: a 0-byte train.tsv)."""

    def setup(scratch: Path, tokenizer: Path) -> list[str]:
        folder = write_glue_task(scratch / "sst2", SST2_HEADER, SST2_ROWS * 4)
        if isinstance(train, bytes):
            (folder / "train.tsv").write_bytes(train)
        else:
            (folder / "train.tsv").write_text(train or "")
        (folder / "dev.tsv").write_text(dev)
        return [
            "--config", str(CONFIGS / "sst2_untied.yaml"),
            "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
            "--model.pretrained", "null", "--model.config", TINY,
            "--data.data_dir", str(folder), "--data.tokenizer", str(tokenizer), "--data.batch_size", "4",
        ]  # fmt: skip

    return setup


def _filled(extra: tuple[str, ...], scratch: Path, tokenizer: Path) -> list[str]:
    """``extra`` with ``{scratch}`` and ``{tokenizer}`` replaced by those folders."""
    return [arg.format(scratch=scratch, tokenizer=tokenizer) for arg in extra]


def sst2_row(train: str | bytes, *extra: str, data_dir: Callable[[Path], str] | None = None) -> Setup:
    """SST-2 run with these train.tsv contents (good dev.tsv), then ``extra`` ({scratch}/{tokenizer} filled in)."""

    def setup(scratch: Path, tokenizer: Path) -> list[str]:
        args = sst2_files(train, GOOD_TSV)(scratch, tokenizer)
        override = ["--data.data_dir", data_dir(scratch)] if data_dir else []
        return [*args, *override, *_filled(extra, scratch, tokenizer)]

    return with_files(setup)


def lm_files(name: str, train: str | bytes, *extra: str) -> Setup:
    """``dplit lm fit`` with scratch/``name`` = ``train``, a one-row val.jsonl and the tiny BPE tokenizer."""

    def setup(scratch: Path, tokenizer: Path, run: Path) -> list[str]:
        path = scratch / name
        path.write_bytes(train if isinstance(train, bytes) else train.encode())
        (scratch / "val.jsonl").write_text('{"text": "It was great."}\n')
        files = ["--data.tokenizer", str(tokenizer), "--data.train_file", str(path), "--data.val_file", str(scratch / "val.jsonl")]
        return ["lm", "fit", *lm_args(run), *files, *_filled(extra, scratch, tokenizer)]

    return setup



def exporting(checkpoint: dict | None, *extra: str, output_file: str | None = None) -> Setup:
    """``dplit export`` of ``checkpoint`` (saved with torch.save; ``None``: a missing file) into ``scratch/out``."""

    def setup(scratch: Path, tokenizer: Path, run: Path) -> list[str]:
        path = scratch / "run.ckpt" if checkpoint is not None else Path("/nonexistent/run.ckpt")
        if checkpoint is not None:
            torch.save(checkpoint, path)
        if output_file is not None:
            (scratch / "out").mkdir()
            (scratch / "out" / output_file).write_text("someone's notes\n")
        return ["export", "--ckpt_path", str(path), "--output_dir", str(scratch / "out"), *extra]

    return setup


def generating(
    prompts: str | bytes, *extra: str, name: str = "prompts.jsonl", samples: str = "2", model: bool = True,
    positions: int | None = None,
) -> Setup:  # fmt: skip
    """``dplit lm generate`` with a prompts file holding ``prompts`` (``model=False``: the model folder is missing).

    ``positions``: a real tiny random GPT-2 with that many positions and the tiny BPE tokenizer (default: a model
    folder whose config has no weights).
    """

    def setup(scratch: Path, tokenizer: Path, run: Path) -> list[str]:
        folder = scratch / "model" if model else Path("/nonexistent/model")
        if positions is not None:
            save_tiny_gpt2(folder, tokenizer, positions)
        elif model:
            folder.mkdir()
            (folder / "config.json").write_text("{}\n")  # a config without weights: never loads
        (scratch / name).write_bytes(prompts if isinstance(prompts, bytes) else prompts.encode())
        return ["lm", "generate", "--model", str(folder), "--prompts_file", str(scratch / name),
                "--num_samples", samples, "--output_file", str(scratch / "synthetic.jsonl"), *extra]  # fmt: skip

    return setup


def kept_partial(setup: Setup) -> Setup:
    """``setup``, beside the ``synthetic.jsonl.partial`` an interrupted ``dplit lm generate`` kept."""

    def with_partial(scratch: Path, tokenizer: Path, run: Path) -> list[str]:
        (scratch / "synthetic.jsonl.partial").write_text('{"prompt": "Write a review:", "sample": 0, "text": "Fine."}\n')
        return setup(scratch, tokenizer, run)

    return with_partial


def save_tiny_gpt2(folder: Path, tokenizer: Path, positions: int) -> None:
    """A random 1-layer GPT-2 with ``positions`` positions and the tiny BPE tokenizer, as ``save_pretrained`` writes it."""
    words = load_tokenizer(str(tokenizer))
    end = words.eos_token_id
    config = GPT2Config(vocab_size=len(words), n_positions=positions, n_layer=1, n_embd=8, n_head=2, bos_token_id=end, eos_token_id=end)
    GPT2LMHeadModel(config).save_pretrained(folder)
    words.save_pretrained(folder)


NO_GPU_ROWS: list[tuple[str, Setup, str]] = [] if torch.cuda.is_available() else [
    ("accelerator-gpu-without-one", flags("--trainer.accelerator", "gpu"), r"^trainer\.accelerator='gpu', .*No supported gpu backend found"),
    ("nccl-backend-on-cpu", flags("--trainer.strategy.init_args.process_group_backend", "nccl"), r"^torch\.distributed could not start the process group \(trainer\.strategy\.init_args\.process_group_backend='nccl'.*NCCL"),
]  # fmt: skip
"""Rows that are bad only on a machine without a CUDA GPU."""

GOOD_TSV = "\n".join([SST2_HEADER, *SST2_ROWS]) + "\n"
CATALOGUE: list[tuple[str, Setup, str]] = [
    ("max-length-above-positions", flags("--data.max_length", "100"), r"data.max_length=100 exceeds .* 64 tokens"),
    (
        "target-epsilon-with-endless-plan",
        flags("--trainer.max_epochs", "-1", "--trainer.max_steps", "-1"),
        r"target_epsilon .* finite trainer.max_epochs or trainer.max_steps",
    ),
    (
        "endless-non-private-linear-decay",
        flags("--trainer.strategy", "auto", "--non_private", "true", "--trainer.max_epochs", "-1", "--trainer.max_steps", "-1"),
        r"model.lr_schedule='linear' .* trainer.max_epochs and trainer.max_steps are both -1",
    ),
    ("text-file-as-checkpoint", with_files(text_checkpoint), r"--ckpt_path .*notes.ckpt: not a checkpoint"),
    ("random-bytes-as-checkpoint", with_files(random_bytes_checkpoint), r"--ckpt_path .*noise.ckpt: not a checkpoint"),
    ("truncated-checkpoint", with_files(truncated_checkpoint), r"^--ckpt_path .*cut\.ckpt: truncated or damaged \(it starts as a torch\.save file"),
    ("checkpoint-pickles-an-object", with_files(object_checkpoint), r"^--ckpt_path .*object\.ckpt: not a checkpoint dplit can load: it pickles builtins\.object"),
    ("missing-checkpoint", flags("--ckpt_path", "/nonexistent/last.ckpt"), r"--ckpt_path /nonexistent/last.ckpt: no such"),
    (
        "missing-pretrained-folder",
        flags("--model.config", "null", "--model.pretrained", "/nonexistent/model"),
        r"model.pretrained='/nonexistent/model': the folder does not exist",
    ),
    ("empty-tsv", with_files(sst2_files(None, GOOD_TSV)), r"train.tsv: the file is empty"),
    ("header-only-tsv", with_files(sst2_files(SST2_HEADER + "\n", GOOD_TSV)), r"train.tsv"),
    ("label-outside-set", with_files(sst2_files(GOOD_TSV + "so so . \t2\n", GOOD_TSV)), r"train.tsv, line 5: the label is not one of the sst2 labels"),
    ("missing-column", with_files(sst2_files("text\tlabel\nfine . \t1\n", GOOD_TSV)), r"train.tsv.*sentence"),
    ("infinite-target-epsilon", flags("--trainer.strategy.init_args.target_epsilon", "inf"), r"^DPStrategy\.target_epsilon must be a finite number > 0, got inf$"),
    ("yaml-infinite-target-epsilon", flags("--trainer.strategy.init_args.target_epsilon", ".inf"), r"target_epsilon must be a finite number > 0, got inf"),
    ("nan-max-grad-norm", flags("--trainer.strategy.init_args.max_grad_norm", "nan"), r"^DPStrategy\.max_grad_norm must be a finite number > 0, got nan$"),
    ("yaml-nan-noise-multiplier", flags("--trainer.strategy.init_args.target_epsilon", "null", "--trainer.strategy.init_args.noise_multiplier", ".nan"), r"noise_multiplier must be a finite number ≥ 0, got nan"),
    ("both-sigma-and-epsilon", flags("--trainer.strategy.init_args.noise_multiplier", "1.0"), r"^set exactly one of DPStrategy.noise_multiplier and DPStrategy.target_epsilon"),
    ("neither-sigma-nor-epsilon", flags("--trainer.strategy.init_args.target_epsilon", "null"), r"^set exactly one of DPStrategy.noise_multiplier"),
    ("unknown-task", flags("--data.task", "mnli"), r"data.task must be one of"),
    ("gradient-clipping-beside-dp", flags("--trainer.gradient_clip_val", "1.0"), r"trainer.gradient_clip_val must be unset"),
    ("accumulation-beside-dp", flags("--trainer.accumulate_grad_batches", "2"), r"trainer.accumulate_grad_batches must be 1"),
    (
        "multi-token-label-word",
        with_files(lambda scratch, tokenizer: [*sst2_files(GOOD_TSV, GOOD_TSV)(scratch, tokenizer), "--data.label_words", '{"0": " magnificent", "1": " great"}']),
        r"data.label_words: the word ' magnificent' for label '0' must be exactly one token",
    ),
    # Lightning's and torch's own refusals of a trainer setting, one line each
    ("trainer-devices-zero", flags("--trainer.devices", "0"), r"^trainer\.accelerator='cpu', trainer\.devices='0': .*not a valid input"),
    *NO_GPU_ROWS,
    # DP is never dropped or weakened silently
    ("strategy-auto-on-a-dp-config", flags("--trainer.strategy", "auto"), r"trainer.strategy='auto' trains WITHOUT differential privacy.*--non_private true"),
    ("strategy-ddp-on-a-dp-config", flags("--trainer.strategy", "ddp"), r"trainer.strategy='ddp' trains WITHOUT differential privacy"),
    ("non-private-beside-dp", flags("--non_private", "true"), r"--non_private true contradicts trainer.strategy=DPStrategy"),
    ("fast-dev-run-beside-dp", flags("--trainer.fast_dev_run", "1"), r"trainer.fast_dev_run is refused with DPStrategy"),
    ("fp16-weights", flags("--trainer.precision", "16-true"), r"trainer.precision='16-true' is not supported with DPStrategy"),
    ("delta-above-one-over-n", flags("--trainer.strategy.init_args.target_delta", "0.1"), r"target_delta=0.1 is ≥ 1/N .*allow_large_delta"),
    ("target-epsilon-beyond-any-guarantee", flags("--trainer.strategy.init_args.target_epsilon", "1e6"), r"^DPStrategy.target_epsilon=1e\+06 must be in \(0, 100\]"),
    ("noise-multiplier-too-small-for-prv", flags("--trainer.strategy.init_args.target_epsilon", "null", "--trainer.strategy.init_args.noise_multiplier", "1e-6"), r"^DPStrategy.noise_multiplier=1e-06 is too small for DPStrategy.accountant='prv' .* use noise_multiplier ≥"),
    ("target-epsilon-out-of-reach", flags("--trainer.strategy.init_args.target_epsilon", "0.05", "--trainer.strategy.init_args.target_delta", "1e-5", "--data.batch_size", "100", "--trainer.max_epochs", "500"), r"^DPStrategy.target_epsilon=0.05 cannot be reached .* raise target_epsilon"),
    ("delta-opacus-cannot-compute", flags("--trainer.strategy.init_args.target_delta", "0.99", "--trainer.strategy.init_args.allow_large_delta", "true"), r"target_delta must be in \(0, 0.1\]"),
    ("resume-with-another-lora-rank", with_files(lora_rank_4_checkpoint), r"^model\.peft\.init_args\.r=8 differs from the checkpoint's 4: --ckpt_path resumes the checkpoint's model"),
    ("validate-missing-checkpoint", lambda scratch, tokenizer, run: ["validate", *quickstart_args(run), "--ckpt_path", "/nonexistent/last.ckpt"], r"^--ckpt_path /nonexistent/last\.ckpt: no such"),
    ("ckpt-path-last-without-checkpoint", flags("--ckpt_path", "last"), r"--ckpt_path last: no checkpoint under .* nothing to resume"),
    ("mistyped-command", lambda scratch, tokenizer, run: ["exprt", "--ckpt_path", str(scratch / "run.ckpt")], r"^invalid choice: 'exprt' \(did you mean 'dplit export'\?\); the commands: fit, validate, test, audit, export, lm fit"),
    ("generate-without-lm", lambda scratch, tokenizer, run: ["generate", "--model", str(scratch)], r"^invalid choice: 'generate' \(did you mean 'dplit lm generate'\?\)"),
    ("predict-subcommand", lambda scratch, tokenizer, run: ["predict", *quickstart_args(run)], r"invalid choice: 'predict'"),
    ("lm-test-subcommand", lambda scratch, tokenizer, run: ["lm", "test", *lm_args(run)], r"invalid choice: 'test'"),
    ("lm-fast-dev-run", lm_flags("--trainer.fast_dev_run", "1"), r"trainer.fast_dev_run is refused with DPStrategy"),
    # config files YAML would read silently wrong, or that belong to another command
    ("config-key-given-twice", second_config("model:\n  lr: 0.01\n  warmup_steps: 2\n  lr: 0.1\n"), r"^--config .*extra\.yaml: model\.lr is given twice \(lines 2 and 4\); YAML would silently keep only the second"),
    ("config-empty", second_config("# nothing yet\n"), r"^--config .*extra\.yaml: the file is empty \(no settings\)$"),
    ("lm-config-given-to-fit", lambda scratch, tokenizer, run: ["fit", "--config", str(CONFIGS / "lm_quickstart.yaml"), "--trainer.default_root_dir", str(run)], r"^--config .*lm_quickstart\.yaml: a config for dplit lm fit \(it sets model\.loss_reduction"),
    ("classifier-config-given-to-lm-fit", lambda scratch, tokenizer, run: ["lm", "fit", *quickstart_args(run)], r"^--config .*quickstart\.yaml: a config for dplit fit \(it sets model\.head, data\.task"),
    ("seed-everything-not-a-bool", flags("--seed_everything", "maybe"), r"^seed_everything='maybe': expected true or false or an integer$"),
    ("init-lora-weights-not-a-bool", flags("--model.peft", '{"class_path": "peft.LoraConfig", "init_args": {"r": 4, "target_modules": ["c_attn"], "init_lora_weights": "maybe"}}'), r"^init_lora_weights='maybe': expected true or false or one of 'gaussian'"),
    ("embeddings-class-path-typo", flags("--model.embeddings", "dplit.embeddings.UntiedEmbedding"), r"^model\.embeddings: Problem with given class_path 'dplit\.embeddings\.UntiedEmbedding': module 'dplit\.embeddings' has no attribute 'UntiedEmbedding'$"),
    # the model, checked before the first private step
    ("config-key-typo", flags("--model.config", '{"n_layers": 2, "n_embd": 64, "n_head": 4, "n_positions": 64}'), r"^model\.config: unknown key 'n_layers' for model_type 'gpt2' \(did you mean 'n_layer'\?\)$"),
    ("unknown-model-type", flags("--model.config", '{"model_type": "lama", "hidden_size": 16}'), r"^model\.config: unknown model_type 'lama' \(did you mean 'llama'.{0,80}common families: gpt2, llama"),
    ("dropout-above-one", flags("--model.dropout", "1.5"), r"^model\.dropout=1\.5: must be a probability in \[0, 1\]$"),
    ("config-dropout-negative", flags("--model.config", '{"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, "resid_pdrop": -0.1}'), r"^model\.config\.resid_pdrop=-0\.1: must be a probability in \[0, 1\]$"),
    ("negative-learning-rate", flags("--model.lr", "-0.001"), r"^model\.lr=-0\.001: must be a finite number > 0$"),
    (
        "checkpointed-share-without-checkpointing",
        flags("--model.checkpointed_share", "0.5"),
        r"^model\.checkpointed_share=0\.5 needs model\.gradient_checkpointing=true",
    ),
    (
        "checkpointed-share-above-one",
        flags("--model.gradient_checkpointing", "true", "--model.checkpointed_share", "2"),
        r"^model\.checkpointed_share=2\.0: must be a finite number in \(0, 1\]$",
    ),
    ("everything-frozen", flags("--model.freeze", '["backbone"]'), r"^model\.freeze=\['backbone'\] froze every parameter: nothing to train$"),
    ("freeze-prefix-typo", flags("--model.freeze", '["backbone.transfomer.wpe"]'), r"^model\.freeze: no parameter name starts with 'backbone\.transfomer\.wpe' \(did you mean 'backbone\.transformer\.wpe'\?\)$"),
    ("per-example-with-sdpa", flags("--trainer.strategy.init_args.clipping", "per_example", "--model.attn_implementation", "sdpa"), r"^DPStrategy\.clipping=per_example cannot run model\.attn_implementation='sdpa'"),
    ("lm-no-sample-tokens", lm_flags("--model.sample_tokens", "0"), r"^model\.sample_tokens=0: must be an integer ≥ 1"),
    # user-level DP settings without the user unit: example-level DP would be trained without a word
    ("max-rows-per-user-without-user-unit", flags("--data.max_rows_per_user", "4"), r"^data\.max_rows_per_user=4 is set but data\.privacy_unit='example': set data\.privacy_unit=user"),
    ("lm-max-rows-per-user-without-user-unit", lm_flags("--data.max_rows_per_user", "4"), r"^data\.max_rows_per_user=4 is set but data\.privacy_unit='example'"),
    ("all-rows-one-user", lm_files("train.jsonl", '{"text": "fine", "author": "ann"}\n' * 8, "--data.privacy_unit", "user", "--data.user_column", "author"), r"train\.jsonl: data\.user_column='author' gives one user for all 8 training rows"),
    ("gguf-file-without-pretrained", flags("--model.gguf_file", "model.gguf"), r"^model\.gguf_file='model\.gguf' needs model\.pretrained: the folder holding the GGUF file$"),
    ("gguf-file-as-pretrained", with_files(gguf_file_as_pretrained), r"^model\.pretrained='.*model\.gguf': is a GGUF file, expected its folder; set model\.pretrained='.*scratch' and model\.gguf_file='model\.gguf'"),
    ("clip-learning-rate-absurd", flags("--trainer.strategy.init_args.clip_mode", "quantile", "--trainer.strategy.init_args.clip_learning_rate", "1000"), r"^DPStrategy\.clip_learning_rate=1000\.0 is above 5\.0: one update moves C by up to a factor e\^η"),
    ("resume-changes-the-privacy-unit", resumed_after("--data.privacy_unit", "user", "--data.max_rows_per_user", "4"), r"^data\.privacy_unit='example' differs from the checkpoint's run, which protected each user \(\d+ users\): its ε cannot continue"),
    # data files and paths
    ("tsv-not-utf8", sst2_row((GOOD_TSV + "it was b\xe9te . \t0\n").encode("latin-1")), r"train.tsv, line 5: not UTF-8 text \(at column 9\)$"),
    ("tsv-only-blank-lines", sst2_row("\n  \n\n"), r"train.tsv: no examples \(only blank lines\)$"),
    ("data-dir-is-a-file", sst2_row(GOOD_TSV, data_dir=lambda scratch: str(scratch / "sst2" / "train.tsv")), r"^data.data_dir='.*train.tsv': is a file, expected a folder"),
    ("tokenizer-is-a-file", sst2_row(GOOD_TSV, "--data.tokenizer", "{tokenizer}/vocab.json"), r"^data.tokenizer='.*vocab.json': is a file, expected a tokenizer folder"),
    ("jsonl-not-utf8", lm_files("train.jsonl", b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "b\xe9te"}\n'), r"train.jsonl, line 3: not UTF-8 text \(at column 12\)$"),
    ("jsonl-line-not-json", lm_files("train.jsonl", '{"text": "fine"}\n{"text": fine}\n'), r"train.jsonl, line 2: not valid JSON \(Expecting value at column 10\)$"),
    ("jsonl-only-blank-lines", lm_files("train.jsonl", "\n  \n\n"), r"train\.jsonl: no examples \(only blank lines\)$"),
    ("csv-unclosed-quote", lm_files("train.csv", 'text\nfine\n"an unclosed quote\n' + "another row\n" * 70), r"train\.csv, line 3: the quote that opens a field on this line is never closed \(the field runs on to line 73"),
    ("tsv-empty-sentence", sst2_row(GOOD_TSV + " \t1\n"), r"train\.tsv, line 5: empty sentence \(nothing to classify\)$"),
    ("train-file-is-a-directory", lm_files("train.jsonl", '{"text": "fine"}\n', "--data.train_file", "{scratch}"), r"^data.train_file='.*': is a directory, expected a .jsonl/.json/.csv/.txt file$"),
    ("lm-hub-dataset-offline", lm_hub_dataset("someuser/private-notes"), r"^data\.dataset='someuser/private-notes' could not be loaded from the Hugging Face hub \(offline, or no such dataset\)"),
    ("lm-empty-sample-prompt", lm_flags("--model.sample_prompts", '["the movie", ""]'), r"^model\.sample_prompts\[1\]='': each prompt must be a non-empty string"),
    ("lm-packing-per-example-engine", lm_flags("--data.packing", "true", "--trainer.strategy.clipping", "per_example"), r"^data\.packing=true needs DPStrategy\.clipping=ghost: the per_example engine clips whole rows"),
    ("lm-packing-document-longer-than-a-row", lm_flags("--data.packing", "true", "--data.overlength", "refuse", "--data.max_length", "8"), r"^builtin corpus \[train, seed=0\], row \d+: \d+ tokens, longer than data\.max_length=8 \(set data\.overlength=truncate to cut it\)$"),
    # peft adapters
    ("peft-not-a-peft-config", flags("--model.peft", '{"class_path": "torch.nn.Linear", "init_args": {"in_features": 2, "out_features": 2}}'), r"^model\.peft: Import path torch\.nn\.Linear does not correspond to a peft config class"),
    ("peft-target-modules-match-nothing", flags("--model.peft", lora_on("q_proj")), r"^model\.peft: Target modules \{'q_proj'\} not found in the base model"),
    ("lora-on-an-embedding", flags("--model.peft", lora_on("wte")), r"^trainable parameter 'backbone\.transformer\.wte\.lora_embedding_A\.default' .*peft\.tuners\.lora\.layer\.Embedding.*target_modules"),
    ("peft-method-no-rule-covers", flags("--model.peft", '{"class_path": "peft.IA3Config", "init_args": {"target_modules": ["c_attn"], "feedforward_modules": []}}'), r"^trainable parameter '.*c_attn\.ia3_l\.default' .*peft\.tuners\.ia3\.layer\.Linear"),
    ("peft-prompt-learning", flags("--model.peft", '{"class_path": "peft.PrefixTuningConfig", "init_args": {"num_virtual_tokens": 4}}'), r"^model\.peft: PrefixTuningConfig is a prompt-learning method"),
    ("peft-weight-tied-copy", flags("--model.embeddings", "dplit.embeddings.TiedEmbeddings", "--model.train_embeddings", "true", "--model.peft", '{"class_path": "peft.LoraConfig", "init_args": {"r": 4, "target_modules": ["c_attn"], "modules_to_save": ["lm_head"], "ensure_weight_tying": true}}'), r"^model\.peft: modules_to_save=\['lm_head'\] with ensure_weight_tying=True .* model\.train_embeddings: true"),
    ("peft-copy-beside-frozen-embeddings", flags("--model.peft", '{"class_path": "peft.LoraConfig", "init_args": {"r": 4, "target_modules": ["c_attn"], "modules_to_save": ["lm_head"]}}'), r"^model\.peft: modules_to_save=\['lm_head'\] asks peft to train a copy of the LM head, but model\.train_embeddings is false"),
    ("peft-trainable-tokens", flags("--model.peft", '{"class_path": "peft.LoraConfig", "init_args": {"r": 4, "target_modules": ["c_attn"], "trainable_token_indices": [1, 2]}}'), r"^model\.peft: trainable_token_indices \(peft's trainable tokens\) is not supported"),
    ("lm-lora-target-typo", lm_flags("--model.peft", lora_on("c_atn")), r"^model\.peft: Target modules \{'c_atn'\} not found"),
    ("lora-alpha-zero", flags("--model.peft", '{"class_path": "peft.LoraConfig", "init_args": {"r": 4, "lora_alpha": 0, "target_modules": ["c_attn"]}}'), r"^model\.peft\.init_args\.lora_alpha=0 scales every LoRA adapter's output by lora_alpha/r = 0"),
    ("peft-not-installed", flags("--model.peft", lora_on("c_attn")), r"^model\.peft needs the 'peft' package, which is not installed: pip install peft$"),
    # preference tuning: dplit dpo fit
    ("dpo-missing-column", dpo_files("train.jsonl", '{"prompt": "Review:", "chosen": "It was great."}\n'), r"^.*train\.jsonl: missing column\(s\) \['rejected'\]; the file has \['prompt', 'chosen'\]$"),
    ("dpo-empty-chosen", dpo_files("train.jsonl", GOOD_PAIR + '{"prompt": "Review:", "chosen": " ", "rejected": "It was bad."}\n'), r"^.*train\.jsonl, row 2: empty chosen answer$"),
    ("dpo-empty-rejected", dpo_files("train.csv", 'prompt,chosen,rejected\nReview:,It was great.,\n'), r"^.*train\.csv, row 1 \(line 2\): empty rejected answer$"),
    ("dpo-chosen-equals-rejected", dpo_files("train.jsonl", '{"prompt": "Review:", "chosen": "It was fine.", "rejected": "It was fine."}\n'), r"^.*train\.jsonl, row 1: the chosen and rejected answers are the same: the pair prefers nothing$"),
    ("dpo-prompt-too-long", dpo_files("train.jsonl", '{"prompt": "' + "the movie was great and " * 4 + '", "chosen": "Yes.", "rejected": "No."}\n'), r"^.*train\.jsonl, row 1: the prompt is \d+ tokens, leaving no room for the answers within data\.max_length=16$"),
    ("dpo-hub-dataset-offline", dpo_hub_dataset("someuser/private-prefs"), r"^data\.dataset='someuser/private-prefs' could not be loaded from the Hugging Face hub \(offline, or no such dataset\)"),
    ("dpo-hub-missing-column", dpo_hub(dict.fromkeys(("train", "test"), '{"prompt": "Review:", "chosen": "It was great."}\n')), r"^.*prefs \[train\]: missing column\(s\) \['rejected'\]; the file has \['prompt', 'chosen'\]$"),
    ("dpo-hub-empty-rejected", dpo_hub({"train": GOOD_PAIR + '{"prompt": "Review:", "chosen": "It was great.", "rejected": ""}\n', "test": GOOD_PAIR}), r"^.*prefs \[train\], row 2: empty rejected answer$"),
    ("dpo-hub-splits-differ", dpo_hub({"train": '{"prompt": "Review:", "chosen": "It was great."}\n', "test": GOOD_PAIR}), r"^data\.dataset='.*prefs': the datasets library could not build this dataset from its files \(\w+; do all of its splits have the same columns\?\)$"),
    ("dpo-hub-no-validation-split", dpo_hub({"train": GOOD_PAIR}), r"^data\.dataset='.*prefs' has no 'validation' split \(it has \['train'\]\)$"),
    ("dpo-hub-user-column-missing", dpo_hub({"train": GOOD_PAIR, "test": GOOD_PAIR}, "--data.privacy_unit", "user", "--data.user_column", "person"), r"^.*prefs \[train\]: missing column\(s\) \['person'\]; the dataset has \['prompt', 'chosen', 'rejected'\] \(data\.user_column\)$"),
    ("dpo-mistyped-subcommand", lambda scratch, tokenizer, run: ["dpo", "fti", *dpo_args(run)], r"^invalid choice: 'fti' \(did you mean 'dplit dpo fit'\?\)"),
    ("dpo-beta-zero", dpo_flags("--model.beta", "0"), r"^model\.beta=0(\.0)?: must be a finite number > 0"),
    ("dpo-per-example-clipping", dpo_flags("--trainer.strategy.init_args.clipping", "per_example"), r"^DPStrategy\.clipping=per_example traces one row at a time, but a preference pair's loss needs both"),
    # the privacy audit: dplit audit and dplit lm audit
    ("audit-one-canary", auditing("--audit.canaries", "1"), r"^audit\.canaries=1: must be an integer ≥ 2$"),
    ("audit-two-canaries", auditing("--audit.canaries", "2"), r"^audit\.canaries=2 cannot refute any claim at 95% confidence: all 2 guesses right happen by chance with probability 2\^-2 = 0\.25; use at least 5"),
    ("audit-confidence-outside-0-1", auditing("--audit.confidence", "1.5"), r"^audit\.confidence=1\.5: must be a finite number in \(0, 1\)$"),
    ("audit-unknown-mode", auditing("--audit.mode", "grey_box"), r"^audit\.mode='grey_box': expected one of 'white_box', 'black_box'$"),
    ("audit-unknown-analysis", auditing("--audit.analysis", "renyi"), r"^audit\.analysis='renyi': expected one of 'fdp', 'eps_delta'$"),
    ("lm-audit-confidence-zero", lambda scratch, tokenizer, run: ["lm", "audit", *lm_args(run), "--audit.confidence", "0"], r"^audit\.confidence=0: must be a finite number in \(0, 1\)$"),
    ("audit-without-dp", auditing("--trainer.strategy", "auto", "--non_private", "true"), r"^dplit audit audits DP-SGD: set trainer\.strategy to dplit\.strategy\.DPStrategy$"),
    ("audit-more-canaries-than-coordinates", auditing("--audit.canaries", "10000000"), r"^audit\.canaries=10000000 exceeds the \d+ trainable coordinates of the model$"),
    # releasing a trained model: dplit export and dplit lm generate
    ("export-missing-checkpoint", exporting(None), r"^--ckpt_path /nonexistent/run\.ckpt: no such file$"),
    ("export-not-a-lightning-checkpoint", exporting({"weights": torch.zeros(2)}), r"^--ckpt_path .*run\.ckpt: not a Lightning checkpoint \(no state_dict\)$"),
    ("export-not-a-dplit-checkpoint", exporting({"state_dict": {"layer.weight": torch.zeros(2)}, "hyper_parameters": {"width": 2}}), r"^--ckpt_path .*run\.ckpt: not a dplit checkpoint"),
    ("export-output-dir-not-empty", exporting({"weights": torch.zeros(2)}, output_file="notes.txt"), r"^--output_dir .*out: exists and is not empty \(pass --overwrite"),
    ("export-overwrite-not-an-export", exporting({"weights": torch.zeros(2)}, "--overwrite", output_file="notes.txt"), r"^--output_dir .*out: --overwrite replaces only an earlier dplit export"),
    ("generate-empty-prompts-file", generating("\n\n", name="prompts.txt"), r"^--prompts_file .*prompts\.txt: no examples \(only blank lines\)$"),
    ("generate-prompts-without-the-column", generating('{"text": "Write a review:"}\n'), r"^--prompts_file .*prompts\.jsonl: missing column\(s\) \['prompt'\]; the file has \['text'\] \(--prompt_column\)$"),
    ("generate-empty-prompt", generating('{"prompt": "Write a review:"}\n{"prompt": " "}\n'), r"^--prompts_file .*prompts\.jsonl, line 2: empty prompt \(--prompt_column 'prompt'\)$"),
    ("generate-prompts-not-utf8", generating(b'{"prompt": "Write a review:"}\n{"prompt": "b\xe9te"}\n'), r"^--prompts_file .*prompts\.jsonl, line 2: not UTF-8 text \(at column 14\)$"),
    ("generate-csv-prompts-unclosed-quote", generating('prompt\n"Write a review:\nWrite a poem:\n', name="prompts.csv"), r"^--prompts_file .*prompts\.csv, line 2: the quote that opens a field on this line is never closed"),
    ("generate-json-prompts-not-objects", generating('["Write a review:", "Write a poem:"]', name="prompts.json"), r"^--prompts_file .*prompts\.json, item 1: expected a JSON object \(one example\), found a JSON string$"),
    ("generate-a-billion-samples", generating('{"prompt": "Write a review:"}\n{"prompt": "Write a poem:"}\n', samples="1000000000"), r"^--num_samples=1000000000: 2 prompt\(s\) × 1000000000 = 2,000,000,000 samples, above the limit of 10,000,000 per run"),
    ("generate-over-a-kept-partial-file", kept_partial(generating('{"prompt": "Write a review:"}\n')), r"^--output_file .*synthetic\.jsonl: .*synthetic\.jsonl\.partial exists \(the samples an interrupted run kept\): move it away, or pass --overwrite"),
    ("generate-zero-samples", generating('{"prompt": "Write a review:"}\n', samples="0"), r"^--num_samples=0: must be an integer ≥ 1$"),
    ("generate-unknown-device", generating('{"prompt": "Write a review:"}\n', "--device", "gpu0"), r"^--device gpu0: not a torch device \(cpu, cuda, cuda:1, \.\.\.\)$"),
    ("generate-model-folder-without-weights", generating('{"prompt": "Write a review:"}\n'), r"^--model .*model: transformers cannot load this folder as a causal LM with its tokenizer \(ValueError\)"),
    ("generate-prompt-fills-the-model", generating("the movie is great and it was a great movie\n", name="prompts.txt", positions=8), r"^--prompts_file line 1: the prompt has \d+ tokens, which leaves no room for --max_new_tokens within the model's limit of 8 positions"),
    ("generate-missing-model", generating('{"prompt": "Write a review:"}\n', model=False), r"^--model /nonexistent/model: no such file or folder$"),
]  # fmt: skip


def without_peft(scratch: Path) -> dict[str, str]:
    """An environment in which ``import peft`` fails, as on a machine where it is not installed."""
    (scratch / "no-peft" / "peft").mkdir(parents=True)
    (scratch / "no-peft" / "peft" / "__init__.py").write_text('raise ImportError("No module named \'peft\'")\n')
    return {"PYTHONPATH": str(scratch / "no-peft")}


def offline(scratch: Path) -> dict[str, str]:
    """An environment without the Hugging Face hub (as on a machine without internet)."""
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


ROW_ENVIRONMENTS: dict[str, Callable[[Path], dict[str, str]]] = {"peft-not-installed": without_peft, "lm-hub-dataset-offline": offline,
                                                                 "dpo-hub-dataset-offline": offline}
"""Rows that need more than the user's environment, by id: the variables they add (given the scratch folder)."""

EXECUTABLE_ONLY = {
    # what only a fresh interpreter reads: PYTHONPATH decides which peft it can import (here peft is imported)
    "peft-not-installed",
    # huggingface_hub and datasets read HF_HUB_OFFLINE / HF_DATASETS_OFFLINE once, when they are imported
    "lm-hub-dataset-offline",
    "dpo-hub-dataset-offline",
    # starts a torch.distributed process group (rendezvous on the MASTER_ADDR/MASTER_PORT the process was started
    # with, which the line names): process-level state that in-process DDP tests of this run would share
    "nccl-backend-on-cpu",
}
"""Rows that cannot run faithfully inside the test process (why, above): they run only through the executable."""

END_TO_END = {
    "mistyped-command",  # the console script's front door, answered before torch is imported (as help is)
    "seed-everything-not-a-bool",  # jsonargparse's own parse error, rewritten into one line (dplit fit)
    "validate-missing-checkpoint",  # dplit validate
    "audit-one-canary",  # dplit audit
    "lm-audit-confidence-zero",  # dplit lm audit
    "lm-max-rows-per-user-without-user-unit",  # dplit lm fit: a user setting without the user unit (issue 50)
    "export-not-a-dplit-checkpoint",  # dplit export
    "generate-prompts-not-utf8",  # dplit lm generate
}
"""Rows that run in the test process AND through the real executable: with :data:`EXECUTABLE_ONLY` they cover every
command (``dplit fit`` and ``dplit lm fit`` there), proving the console script and its one-line stderr end to end."""

IN_PROCESS_ROWS = [row for row in CATALOGUE if row[0] not in EXECUTABLE_ONLY]
EXECUTABLE_ROWS = [row for row in CATALOGUE if row[0] in EXECUTABLE_ONLY | END_TO_END]


def row_command(row: tuple[str, Setup, str], folder: Path, tokenizer: Path) -> tuple[list[str], dict[str, str]]:
    """The command line after ``dplit`` and the environment of ``row``, run in ``folder`` (scratch/ and run/ in it)."""
    name, setup, _ = row
    (folder / "scratch").mkdir()
    args = setup(folder / "scratch", tokenizer, folder / "run")
    return args, {**user_environment(), **ROW_ENVIRONMENTS.get(name, lambda scratch: {})(folder / "scratch")}


def check_refused(result: subprocess.CompletedProcess[str], message: str, run: Path) -> None:
    """Exit 2, no traceback, ONE ``dplit: error:`` line (last on stderr) matching ``message``; nothing written."""
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("dplit: error:")]
    assert result.returncode == 2 and "Traceback" not in output, output
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), output
    assert re.search(message, errors[0].removeprefix("dplit: error: ")), errors[0]
    assert not list(run.rglob("privacy_ledger.json")) and not list(run.rglob("*.ckpt"))


@pytest.mark.parametrize("row", IN_PROCESS_ROWS, ids=[row[0] for row in IN_PROCESS_ROWS])
def test_bad_input_is_refused_in_one_line_before_the_first_step(
    row: tuple[str, Setup, str], tmp_path: Path, tiny_bpe_dir: Path
) -> None:
    """The row through ``dplit.__main__.main`` in this process (:func:`run_dplit_in_process`: seconds per row saved)."""
    args, environment = row_command(row, tmp_path, tiny_bpe_dir)
    check_refused(run_dplit_in_process(*args, environment=environment, cwd=tmp_path), row[2], tmp_path / "run")


@pytest.fixture(scope="module")
def executable_outcomes(
    tmp_path_factory: pytest.TempPathFactory, tiny_bpe_dir: Path
) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """The :data:`EXECUTABLE_ROWS` run through the real executable, a few at a time: id → (result, run folder)."""

    def run(row: tuple[str, Setup, str]) -> tuple[str, tuple[subprocess.CompletedProcess[str], Path]]:
        folder = tmp_path_factory.mktemp(row[0])
        args, environment = row_command(row, folder, tiny_bpe_dir)
        result = subprocess.run(
            [dplit_executable(), *args], capture_output=True, text=True, timeout=600, cwd=folder, check=False,
            env=environment,
        )  # fmt: skip
        return row[0], (result, folder / "run")

    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        return dict(pool.map(run, EXECUTABLE_ROWS))


@pytest.mark.slow
@pytest.mark.parametrize("row", EXECUTABLE_ROWS, ids=[row[0] for row in EXECUTABLE_ROWS])
def test_the_dplit_executable_refuses_in_one_line(
    row: tuple[str, Setup, str], executable_outcomes: dict[str, tuple[subprocess.CompletedProcess[str], Path]]
) -> None:
    result, run = executable_outcomes[row[0]]
    check_refused(result, row[2], run)


def test_every_row_named_for_the_executable_is_in_the_catalogue() -> None:
    """A renamed row must not silently drop out of the end-to-end runs (the no-GPU rows exist only without one)."""
    names = {row[0] for row in CATALOGUE}
    assert END_TO_END <= names and EXECUTABLE_ONLY <= names | ({"nccl-backend-on-cpu"} - {row[0] for row in NO_GPU_ROWS})


def test_16_bit_loss_scaling_is_refused_where_a_grad_scaler_exists(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu")  # what '16-mixed' builds on a GPU; Lightning swaps it for bf16 on a CPU
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    strategy = DPStrategy(accelerator="cpu", max_grad_norm=1.0, noise_multiplier=1.0, precision_plugin=plugin)
    trainer = L.Trainer(strategy=strategy, devices=1, max_steps=1, default_root_dir=tmp_path, logger=False)
    with pytest.raises(ValueError, match=r"trainer.precision .16-mixed. \(loss scaling\) is not supported"):
        trainer.fit(make_model(), RandomTokenData())
    assert trainer.global_step == 0
