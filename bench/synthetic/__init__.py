"""DP synthetic data, end to end: from private SST-2 rows to accuracy on the real SST-2 dev set.

Private SST-2 rows → a DP language model → labelled synthetic reviews → a NON-private classifier trained on the
synthetic rows only → accuracy on the real SST-2 dev set.

    python -m bench.synthetic --smoke     # 32 private rows, 1 ε, 64 dev rows: a few minutes (a check)
    python -m bench.synthetic             # default CPU profile (see PROFILES): under an hour on 2 CPU cores
    python -m bench.synthetic --full      # all 67,349 rows, LM batch and lr of configs/smollm2_lm.yaml: a GPU
    python -m bench.synthetic --hub --data-dir DIR   # weights and tokenizer from the hub, SST-2 TSVs from DIR

For each ε and seed the pipeline runs dplit's own commands, each in its own process:

1. ``dplit lm fit --config configs/smollm2_lm.yaml``: SmolLM2-135M-Instruct (tied) fine-tuned with DPStrategy at
   ``target_epsilon`` = ε on the private rows as instructions: prompt = the row's label control prompt
   (:data:`CONTROL_PROMPTS`, public strings), response = the review (the loss is on the response only);
2. ``dplit export``: the checkpoint as a Hugging Face folder with its card (the ε the table shows is the card's);
3. ``dplit lm generate``: ``--synthetic-per-label`` samples per control prompt, so every synthetic row has a label;
4. ``dplit fit --non_private true`` on the synthetic rows only (post-processing: no privacy is spent), with the
   shipped ``configs/smollm2_sst2_tied.yaml`` classifier, validated on the real dev split.

Beside it, with the same rows, ε and seed: the DP classifier trained directly on the private rows (the tying study's
``dp_tied`` arm, :mod:`bench.tying`), the zero-shot classifier, and the control: steps 3-4 from the pretrained
model itself (no private row read), which shows what the DP fine-tuning added. The synthetic set is also described: its
size and label balance, distinct-1/2/3 (distinct n-grams over all n-grams, lower-cased words), and the share of its
8-grams found verbatim in the private training rows, beside the same share for real held-out SST-2 rows (what
unrelated text of the same kind shares by chance), and the share of synthetic rows that repeat a private row whole
(memorisation; the control prompts are not part of any sample). Words are lower-cased and split as SST-2 is
(punctuation and clitics such as "n't" and "'s" apart), so the fine-tuned LM's SST-2-like text and the pretrained
model's ordinary English are counted alike.

Everything reads only the first ``--train-examples`` rows of SST-2's train.tsv (the private set); the next
``--lm-val-examples`` rows are the LM's validation file (a perplexity it logs, never used to choose anything; with the
whole split private, as in ``--full``, its last rows, so then only a training-fit monitor); the dev split is only
the final evaluation. The pipeline reads SST-2 from local TSVs (``$DPLIT_DATA_DIR``, ``--data-root`` or
``--data-dir``); the pretrained control needs a local model folder (it is left out, saying why, otherwise). ``results.json``, ``table.md`` go to ``--out`` (default
``bench/results/synthetic/``), logs, checkpoints, exports and synthetic sets to ``--logs`` (git-ignored).
"""
