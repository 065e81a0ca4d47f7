"""Tied vs untied embeddings under DP-SGD on a real pretrained LM and task: SmolLM2-135M-Instruct on GLUE SST-2.

    python -m bench.tying --smoke        # tiny subset, 1 seed, 1 ε, 64 dev rows: a few minutes (a check)
    python -m bench.tying                # default CPU profile (see PROFILES): many hours, resumable
    python -m bench.tying --full         # the paper's recipe (all 67,349 rows, B=1000, 3 epochs): for a GPU
    python -m bench.tying --hub          # weights, tokenizer and GLUE from the Hugging Face hub
    python -m bench.tying --arms lora_tied lora_untied lora_frozen   # any subset of ARMS

Arms (:data:`ARMS`), all with the same hyperparameters (expected batch, epochs, max_length, label words, seeds) and,
for the DP arms, the same privacy budget; full fine-tuning at ``--lr``, LoRA at ``--lora-lr``:

* ``zero_shot``: the pretrained model, no training, validation only (``dplit validate``).
* ``non_private``: the same module trained without ``DPStrategy`` (``--trainer.strategy auto --non_private true``), at
  the learning rate a sweep chose (``--sweep-lrs``, one seed, each candidate trained on the scale's rows and validated
  on the last ``--holdout-rows`` rows of SST-2 train: held-out training rows, never the dev set); on the first
  ``--reference-seeds`` seeds.
* ``dp_tied`` / ``dp_untied``: full fine-tuning with ``DPStrategy`` (ghost clipping, ``target_epsilon`` = ε) from
  ``configs/smollm2_sst2_tied.yaml`` (``TiedEmbeddings``, SmolLM2's own) and ``configs/smollm2_sst2_untied.yaml``
  (``UntiedEmbeddings(init="copy")``).
* ``lora_tied`` / ``lora_untied`` / ``lora_frozen``: ``configs/smollm2_sst2_lora.yaml`` (rank-8 LoRA on every
  projection) beside the trained tied embedding, beside a trained untied copy, or with the embedding frozen.

The grid is every arm × ε × seed at every data scale (``--train-examples``: the FIRST N rows of SST-2's train.tsv),
validated once after training on the whole GLUE dev split (872 rows unless ``--eval-examples``). Untied − tied is
compared per seed (:mod:`bench.study.paired`: mean, paired-t interval, sign test, verdict). Runs go in priority
order, ``--jobs`` at a time: full fine-tuning at each scale with its non-private reference, then LoRA.

The study resumes: each arm is recorded in ``results.json`` as it ends, with a fingerprint: the reviewed study code
version (:data:`bench.study.version.STUDY_CODE_VERSION`, not the git history of ``dplit/``, so moving code keeps
the grid), a digest of its config's content and its dplit command without this machine's paths (classes by name);
:mod:`bench.study.version` says what keeps and what invalidates a recorded arm. A rerun with the same settings
skips every arm already recorded with the same fingerprint and drops rows recorded under other settings or code
(rows of an older format are migrated as they are read: :func:`migrate_record`). So the grid can span several
sittings (``--fresh`` starts over). Each arm is ``dplit``'s own CLI in its own process
(:mod:`bench.study.arm`). ``results.json`` (every run, the summary, sittings, machine, commit), ``table.md`` and
``chart.png`` go to ``--out`` (default ``bench/results/tying/``); Lightning logs and each arm's output to
``--logs`` (default ``bench/out/tying/``, git-ignored).

Default CPU profile (see PROFILES): 160 and 1,000 rows, expected batch 8, 1 epoch (20 and 125 optimizer steps),
max_length 64 (no dev prompt is longer than 61 tokens), 10 seeds, ε ∈ {3, 8}, arms zero-shot, non-private, DP
tied/untied and DP LoRA tied/untied; 2 arms at a time with 1 torch thread each. At this scale DP-SGD cannot be
expected to move the model far from its starting point (the privacy noise scales with 1/(N·ε)); ``--full`` is the
paper-sized study, for a GPU.

Speed measures that change nothing in the maths: each arm runs with 1 torch thread (OMP_NUM_THREADS too); the GGUF
checkpoint is dequantised once into a float32 folder (``--no-cache`` to load the GGUF in every arm); dev.tsv is
validated from a length-sorted copy (``--no-sort-dev`` for the file's order), which halves padding.
"""
