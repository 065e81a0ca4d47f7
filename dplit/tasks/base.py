"""CausalLMModule: what every dplit LightningModule shares: a causal LM backbone, its embedding policy, AdamW."""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import math
import tempfile
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from typing_extensions import override

from dplit.backbone.adapters import (
    AdapterConfig,
    adapter_hyperparameter,
    apply_adapters,
    set_embeddings_trainable,
    trainable_counts,
)
from dplit.backbone.causal_lm import build_causal_lm, downloaded_folder
from dplit.backbone.checkpointing import enable_activation_checkpointing
from dplit.backbone.embeddings import EmbeddingPolicy, UntiedEmbeddings
from dplit.backbone.quantization import (
    add_quantized_weights,
    check_quantization_source,
    drop_quantized_weights,
    quantization_config,
    refuse_trainable_quantized,
)
from dplit.backbone.sharding import shard_task
from dplit.flag_types import NonNegativeInteger, NonNegativeNumber, PositiveNumber, check
from dplit.numbers import is_finite_number, require_finite_number
from dplit.privacy.export_seal import sealed_weight_files
from dplit.privacy.history import (
    GUARANTEE_FILE,
    HISTORY_KEY,
    PrivacyHistory,
    history_in_checkpoint,
    inherited_history,
)
from dplit.privacy.integrity import record_digest, record_weights_digest
from dplit.privacy.optimizer_watch import watch_optimizer_steps
from dplit.privacy.warnings import PrivacyWarning
from dplit.privacy.weights_content import Gather, content_digest
from dplit.tasks.provenance import RELEASE_KEY, release_record

Batch = dict[str, Tensor]

BACKBONE_KEY = "dplit_backbone_config"
"""The checkpoint entry holding the backbone's config (plain types): ``dplit export`` builds the model from it."""

TOKENIZER_KEY = "dplit_tokenizer"
"""The checkpoint entry holding the data's tokenizer as its ``save_pretrained`` files (name → bytes)."""


class CausalLMModule(LightningModule, ABC):
    """A causal LM backbone with an embedding policy, trained by AdamW with linear warm-up and decay.

    The arguments below are every task's: a task subclass takes its own (keyword) arguments and ``**kwargs``,
    which it passes on with ``super().__init__(**kwargs)``. The CLI follows ``**kwargs`` here for the ``--model.*``
    flags and their help, and ``save_hyperparameters`` collects the arguments of both ``__init__``. The subclass
    then adds its layers, calls :meth:`apply_freeze` (``freeze`` may name those layers) and defines
    :meth:`per_example_loss`, the loss DPStrategy clips example by example.

    Args:
        pretrained: hub name (``"gpt2"``, ``"HuggingFaceTB/SmolLM2-135M-Instruct"``, ``"Qwen/Qwen2.5-0.5B"``) or
            local folder of any checkpoint ``transformers.AutoModelForCausalLM`` loads.
        gguf_file: a GGUF checkpoint file inside the ``pretrained`` folder (needs the ``gguf`` package).
        config: keyword arguments of a model config for a randomly initialised backbone (tests, quickstart),
            with its ``model_type`` (``"gpt2"`` when absent, e.g. ``{model_type: llama, hidden_size: 32, ...}``).
            Set exactly one of ``pretrained`` and ``config``. A key the family's config class does not know
            (a typo such as GPT-2's ``n_layers``) is refused with the closest known key.
        embeddings: the :class:`~dplit.backbone.embeddings.EmbeddingPolicy` (default: untied, copied from the input embedding).
        vocab_size: tokenizer size (linked from the data); sets the vocabulary of a config-built backbone, checked
            for a pretrained one.
        max_length: the longest sequence the data will feed (linked from ``data.max_length``); refused when
            above the backbone's position limit (``max_position_embeddings`` / GPT-2's ``n_positions``).
        dropout: overrides the backbone's dropout probabilities (in [0, 1]; ``None`` keeps the checkpoint's).
        peft: a peft adapter config, applied after the embedding policy (base weights frozen), e.g.
            ``{class_path: peft.LoraConfig, init_args: {r: 8, target_modules: [q_proj, v_proj]}}``.
        train_embeddings: whether the input/output embedding (tied: the one shared matrix; untied: both) is
            trained; ``None``: trained in full fine-tuning, frozen beside ``peft`` adapters (as peft does).
        freeze: parameter-name prefixes to freeze, e.g. ``["backbone.transformer.wpe"]``; each must match a
            parameter, and some parameter must stay trainable.
        attn_implementation: transformers attention kernel: ``"eager"`` (default; works with every clipping
            engine) or ``"sdpa"`` (faster on GPU; not traceable by ``clipping="per_example"``'s vmap).
        quantization: a transformers ``BitsAndBytesConfig`` as a dict (``{load_in_4bit: true, bnb_4bit_quant_type:
            nf4, bnb_4bit_compute_dtype: bfloat16}``, or ``{load_in_8bit: true}``): the base from ``pretrained`` is
            loaded quantised and frozen (QLoRA; needs ``peft`` and the ``bitsandbytes`` package). Its quantised
            weights are left out of checkpoints and reloaded from ``pretrained``.
        gradient_checkpointing: recompute each transformer block's activations in the backward pass instead of
            keeping them (less memory for long sequences and large batches, about one more forward pass of
            time); exact under the ghost engine, refused by ``clipping="per_example"``.
        checkpointed_share: with ``gradient_checkpointing``, the share of transformer blocks recomputed (the first
            ⌈share · blocks⌉, in (0, 1], default all): the others keep their activations, trading memory for time.
        lr: AdamW peak learning rate (finite, > 0).
        weight_decay: AdamW weight decay (≥ 0).
        betas: AdamW betas (each in [0, 1)).
        warmup_steps: optimizer steps of linear warm-up, before the linear decay to zero (or the constant ``lr``).
        lr_schedule: ``"linear"`` (warm-up then decay to zero) or ``"constant"``.
    """

    SHARDED_ENTRY_POINTS: tuple[str, ...] = ()
    """Methods besides ``forward`` that reach the backbone (sharded weights are gathered around them too)."""

    def __init__(
        self,
        *,
        pretrained: str | None = None,
        gguf_file: str | None = None,
        config: dict[str, Any] | None = None,
        embeddings: EmbeddingPolicy | None = None,
        vocab_size: int | None = None,
        max_length: int | None = None,
        dropout: float | None = 0.0,
        peft: AdapterConfig | None = None,
        train_embeddings: bool | None = None,
        freeze: list[str] | None = None,
        attn_implementation: Literal["eager", "sdpa"] = "eager",
        quantization: dict[str, Any] | None = None,
        gradient_checkpointing: bool = False,
        checkpointed_share: float = 1.0,
        lr: PositiveNumber = 5e-4,
        weight_decay: NonNegativeNumber = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: NonNegativeInteger = 0,
        lr_schedule: Literal["linear", "constant"] = "linear",
    ) -> None:
        super().__init__()
        given_peft = peft
        peft = adapter_hyperparameter(peft) if peft is not None else None  # plain types: weights_only checkpoints
        self.save_hyperparameters(ignore=["embeddings"])  # the policy object stays out of pickled checkpoints
        if peft is not None and self.hparams.get("peft") is given_peft:
            # the subclass's **kwargs hold the peft object as given, and its frame's arguments win: keep the plain one
            self.hparams.peft = peft
            self._hparams_initial = copy.deepcopy(self.hparams)  # what loggers get, copied as Lightning copies it
        check_optimizer_settings(lr, weight_decay, betas, warmup_steps, lr_schedule)
        require_finite_number(checkpointed_share, name="model.checkpointed_share", above=0, maximum=1)
        self._freeze = list(freeze or [])
        self.privacy_history = PrivacyHistory()
        self.register_load_state_dict_post_hook(lambda module, _: module.privacy_history.weights_loaded())
        watch_optimizer_steps(self)
        self.embeddings = embeddings if embeddings is not None else UntiedEmbeddings()
        if quantization is not None:
            check_quantization_source(pretrained=pretrained, gguf_file=gguf_file, peft=peft)
        self.backbone = build_causal_lm(
            pretrained=pretrained,
            gguf_file=gguf_file,
            config=config,
            vocab_size=vocab_size,
            dropout=dropout,
            attn_implementation=attn_implementation,
            quantization=quantization_config(quantization) if quantization is not None else None,
        )
        self._origin = self._inherit_history(pretrained, gguf_file)
        _check_max_length(max_length, self.max_positions)
        self.embeddings.apply(self.backbone)
        if gradient_checkpointing:
            enable_activation_checkpointing(self.backbone, share=checkpointed_share)
        elif checkpointed_share != 1.0:
            raise ValueError(
                f"model.checkpointed_share={checkpointed_share!r} needs model.gradient_checkpointing=true (it is the "
                "share of blocks recomputed)"
            )
        if peft is not None:
            apply_adapters(self.backbone, peft, train_embeddings=bool(train_embeddings))
        elif train_embeddings is not None:
            set_embeddings_trainable(self.backbone, train_embeddings)

    def _inherit_history(self, pretrained: str | None, gguf_file: str | None) -> str:
        """Continue the history of the folder (or downloaded hub snapshot) the weights came from; their origin."""
        if pretrained is None or Path(pretrained).expanduser().is_dir():
            inherited, inherited_from = inherited_history(pretrained)
        else:  # a hub model: its downloaded files, with the repository's dp_guarantee.json when it has one
            snapshot = downloaded_folder(pretrained, fetch=(GUARANTEE_FILE, "README.md"))
            if snapshot is not None:  # every weight file the guarantee seals (a classifier's head too)
                downloaded_folder(pretrained, fetch=tuple(sealed_weight_files(snapshot)))
            inherited, inherited_from = inherited_history(snapshot, name=f"hub model {pretrained}")
        self.privacy_history.extend(inherited)
        return inherited_from or starting_point(pretrained=pretrained, gguf_file=gguf_file)

    @classmethod
    def argument_names(cls) -> frozenset[str]:
        """The keyword arguments ``cls(...)`` takes: its own ``__init__``'s and those its ``**kwargs`` passes on.

        ``inspect.signature(cls)`` shows a task's own arguments and ``**kwargs`` only; rebuilding a module from a
        checkpoint's hyperparameters needs all of them (and nothing else, such as LightningCLI's ``_instantiator``).
        """
        names: set[str] = set()
        for owner in cls.__mro__:
            init = owner.__dict__.get("__init__")
            if init is None:
                continue
            parameters = list(inspect.signature(init).parameters.values())[1:]  # without self
            names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            if not any(p.kind is p.VAR_KEYWORD for p in parameters):
                break
        return frozenset(names)

    @abstractmethod
    def per_example_loss(self, batch: Batch) -> Tensor:
        """The loss of each example [B], example i's depending on example i only: DPStrategy clips its gradients."""

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the backbone's position embedding or rotary setting allows (``None``: no limit known)."""
        return getattr(self.backbone.config, "max_position_embeddings", None)

    def apply_freeze(self, *, also_frozen_by: str | None = None) -> None:
        """Freeze every parameter whose name starts with one of the ``freeze`` prefixes (each must match something).

        A subclass calls it last in its ``__init__``, once its own layers exist (``freeze`` may name them).

        Args:
            also_frozen_by: the task setting that also froze parameters (named when nothing is left to train).

        Raises:
            ValueError: for a prefix that matches no parameter name (with the closest name), or when no
                trainable parameter is left.
        """
        prefixes = self._freeze
        names = [name for name, _ in self.named_parameters()]
        for prefix in prefixes:
            matched = [n for n in names if n.startswith(prefix)]
            if not matched:
                hint = _closest_prefix(prefix, names)
                raise ValueError(f"model.freeze: no parameter name starts with {prefix!r}{hint}")
            for name, param in self.named_parameters():
                if name in matched:
                    param.requires_grad_(False)
        if not any(p.requires_grad for p in self.parameters()):
            raise ValueError(nothing_to_train(prefixes, also_frozen_by))
        refuse_trainable_quantized(self)
        self.privacy_history.record_origin(self._origin, self.digest_of_weights())

    def weights_state(self) -> dict[str, Any]:
        """The state dict the privacy history's digest covers: all of it but a quantised base (reloaded, frozen)."""
        state = dict(self.state_dict())
        drop_quantized_weights(self, state)
        return state

    def digest_of_weights(self, gather: Gather | None = None) -> str:
        """The content digest of :meth:`weights_state` (``gather``: the ranks' collective, for sharded weights)."""
        return content_digest(self.weights_state(), gather=gather)

    @override
    def configure_model(self) -> None:
        """Under a sharded strategy (a device mesh is set), wrap each transformer block and the task with FSDP2."""
        if self.device_mesh is not None and not isinstance(self, FSDPModule):
            shard_task(self, self.device_mesh["data_parallel"], entry_points=self.SHARDED_ENTRY_POINTS)

    @override
    def on_fit_start(self) -> None:
        """Log what is trained (adapter, embedding, other parameters) and record it and the embedding policy."""
        counts = trainable_counts(self, self.backbone)
        rank_zero_info(counts.describe())
        facts = {f"trainable/{kind}": value for kind, value in vars(counts).items()}
        for logger in self.loggers:
            logger.log_hyperparams({"embedding_policy": repr(self.embeddings), **facts})

    @override
    def on_train_start(self) -> None:
        """Watch every optimizer step on these weights (a copied module too): one no DP step announced is not private."""
        watch_optimizer_steps(self)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take the privacy history that came with the checkpoint's weights (or the one its ledger implies).

        The history object stays the same, its content replaced: a DP-SGD run built before the weights were restored
        (Lightning's FSDP2 strategy restores after setup) holds it, and must count what the weights carry.
        """
        self.privacy_history.load_state_dict(history_in_checkpoint(checkpoint).state_dict())
        if "state_dict" in checkpoint:  # (Lightning's FSDP2 loader takes the weights out before this hook)
            add_quantized_weights(self, checkpoint["state_dict"])  # saved without them: the base's, reloaded
            self._hold_float64(checkpoint["state_dict"])

    def _hold_float64(self, state: dict[str, Any]) -> None:
        """Make a float32 module float64 before float64 weights load into it (so they load exactly, not rounded)."""
        values = [value for value in state.values() if isinstance(value, Tensor) and value.is_floating_point()]
        params = list(self.parameters())
        wide = bool(values) and all(value.dtype == torch.float64 for value in values)
        if wide and params and all(param.dtype == torch.float32 for param in params):
            self.double()

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record all ``dplit export`` needs, and seal the weights and their privacy history with a digest.

        Recorded: the weights' privacy history, the classes, embedding policy, dplit commit, backbone config and
        tokenizer. The digest is checked on resume and export; the config and tokenizer only shape the release, a
        post-processing of the weights.
        """
        datamodule = getattr(self._trainer, "datamodule", None)
        checkpoint[RELEASE_KEY] = release_record(self, datamodule)
        drop_quantized_weights(self, checkpoint["state_dict"])  # the frozen base's: model.pretrained holds them
        if checkpoint["state_dict"]:  # (empty on the ranks a sharded checkpoint is not gathered on)
            saved = content_digest(checkpoint["state_dict"])
            self._seal_weights(self._own_digest(checkpoint["state_dict"], saved), saved)
            record_weights_digest(checkpoint, saved)
        checkpoint[HISTORY_KEY] = self.privacy_history.state_dict()
        checkpoint[BACKBONE_KEY] = backbone_config(self.backbone)
        tokenizer = getattr(datamodule, "tokenizer", None)
        if isinstance(tokenizer, PreTrainedTokenizerBase):
            checkpoint[TOKENIZER_KEY] = tokenizer_files(tokenizer)
        record_digest(checkpoint, HISTORY_KEY)

    def _own_digest(self, saved_state: dict[str, Any], saved: str) -> str:
        """The digest of the module's own weights: ``saved`` when the checkpoint holds them, not derived ones.

        A callback may save weights derived from the DP iterates instead (Lightning's ``EMAWeightAveraging`` saves
        their average); the module's own weights are what the next fit starts from. Sharded weights are taken as
        saved (hashing the shards would need a collective here).
        """
        own = self.weights_state()
        same = saved_state.keys() == own.keys() and all(
            not isinstance(value, Tensor) or value.data_ptr() == own[name].data_ptr()
            for name, value in saved_state.items()
        )
        if same or any(isinstance(value, DTensor) for value in own.values()):
            return saved
        return content_digest(own)

    def _seal_weights(self, digest: str, saved: str) -> None:
        """Seal the module's weights in their history (a change no recorded step explains is recorded first).

        Args:
            digest: the module's own weights' digest.
            saved: the digest of the weights the checkpoint holds (derived ones, inside a DP fit, are sealed too).
        """
        in_fit = self.privacy_history.in_dp_segment
        line = self.privacy_history.verify(digest, where="found when a checkpoint was saved")
        if line is not None:
            warnings.warn(f"dplit: {line}", PrivacyWarning, stacklevel=2)
        if saved != digest and in_fit:
            self.privacy_history.seal(digest, derived=(saved,))

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW with linear warm-up and (by default) linear decay to zero over the planned steps."""
        params = [p for p in self.parameters() if p.requires_grad]
        hp = self.hparams
        if not params:
            raise ValueError(nothing_to_train(hp.get("freeze") or [], None))
        optimizer = torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))
        planned = self.trainer.estimated_stepping_batches
        if not math.isfinite(planned) and hp.lr_schedule == "linear":
            raise ValueError(
                "model.lr_schedule='linear' decays to zero over the planned steps, but trainer.max_epochs and "
                "trainer.max_steps are both -1: set one of them, or use model.lr_schedule=constant"
            )
        total = max(1, int(planned)) if math.isfinite(planned) else 1
        warmup, schedule = hp.warmup_steps, hp.lr_schedule
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_scale(step, warmup=warmup, total=total, schedule=schedule)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def lr_scale(step: int, *, warmup: int, total: int, schedule: str) -> float:
    """The learning rate's factor at optimizer step ``step`` (from 0) of ``total``, after ``warmup`` steps of warm-up.

    It is transformers' ``get_linear_schedule_with_warmup`` (``schedule="linear"``: warm-up, then decay to zero) or
    ``get_constant_schedule_with_warmup`` (``"constant"``) one step on, with one more warm-up and planned step: theirs
    starts at lr 0, and under DP-SGD a step at lr 0 spends ε for no update (a test holds the two equal).
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    return max(0.0, (total - step) / max(1, total - warmup))


def starting_point(*, pretrained: str | None, gguf_file: str | None) -> str:
    """The public weights a model starts from, in words a card can publish (a local folder by its name only)."""
    if pretrained is None:
        return "random initialisation from model.config"
    gguf = f", GGUF file {Path(gguf_file).name}" if gguf_file else ""
    folder = Path(pretrained).expanduser()
    if folder.is_dir():
        return f"local folder {folder.resolve().name}{gguf}"
    return f"hub model {pretrained}{gguf}"


def backbone_config(backbone: PreTrainedModel) -> dict[str, Any]:
    """The backbone's whole config (``to_dict``) in plain JSON types, as a ``weights_only`` checkpoint keeps it."""
    return json.loads(backbone.config.to_json_string(use_diff=False))


def tokenizer_files(tokenizer: PreTrainedTokenizerBase) -> dict[str, bytes]:
    """The files ``tokenizer.save_pretrained`` writes, by name (a few MB at most: ``tokenizer.json`` and its config)."""
    with tempfile.TemporaryDirectory(prefix="dplit-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        return {path.name: path.read_bytes() for path in sorted(Path(folder).iterdir()) if path.is_file()}


def positions_of(attention_mask: Tensor) -> Tensor:
    """Position ids [B, T] counting real tokens only, so left and right padding give the same ids."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]


def _check_max_length(max_length: int | None, limit: int | None) -> None:
    if max_length is not None and limit is not None and max_length > limit:
        raise ValueError(
            f"data.max_length={max_length} exceeds the model's position limit of {limit} tokens "
            "(max_position_embeddings / n_positions): lower data.max_length"
        )


def check_optimizer_settings(
    lr: float, weight_decay: float, betas: Sequence[float], warmup_steps: int, lr_schedule: str
) -> None:
    """Refuse AdamW and schedule settings torch would only reject in ``configure_optimizers`` (or never)."""
    check(lr, PositiveNumber, flag="model.lr")
    check(weight_decay, NonNegativeNumber, flag="model.weight_decay")
    if len(betas) != 2 or not all(is_finite_number(beta, minimum=0, below=1) for beta in betas):
        raise ValueError(f"model.betas={list(betas)!r}: must be two numbers in [0, 1)")
    check(warmup_steps, NonNegativeInteger, flag="model.warmup_steps")
    if lr_schedule not in ("linear", "constant"):
        raise ValueError(f"model.lr_schedule={lr_schedule!r}: must be 'linear' or 'constant'")


def nothing_to_train(prefixes: list[str], also_frozen_by: str | None) -> str:
    """The message for a model whose every parameter is frozen, naming the settings that froze them."""
    causes = [f"model.freeze={list(prefixes)!r}"] if prefixes else []
    causes += [also_frozen_by] if also_frozen_by else []
    return f"{' and '.join(causes) or 'the model settings'} froze every parameter: nothing to train"


def _closest_prefix(prefix: str, names: list[str]) -> str:
    """`` (did you mean 'X'?)`` for the nearest module path of a parameter, or the top-level paths."""
    paths = sorted({".".join(name.split(".")[:depth]) for name in names for depth in range(1, name.count(".") + 2)})
    if any(path.startswith(f"backbone.{prefix}") for path in paths):
        return f" (did you mean 'backbone.{prefix}'?)"
    close = difflib.get_close_matches(prefix, paths, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    tops = sorted({".".join(name.split(".")[:2]) for name in names})
    return f" (parameter names start with {', '.join(repr(top) for top in tops)})"
