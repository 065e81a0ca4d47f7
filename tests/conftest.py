"""Shared fixtures: tiny float64 models, the real-data folder, quiet offline environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tokenizers import ByteLevelBPETokenizer

from tests.helpers.paths import SMOLLM2_GGUF

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one pytest-xdist worker per core: one thread each, and in its children
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture
def shared_data_dir() -> Path:
    """The folder with real GLUE SST-2 TSVs and the GPT-2 tokenizer, from ``DPLIT_DATA_DIR``."""
    return _shared_data()


def _shared_data() -> Path:
    folder = os.environ.get("DPLIT_DATA_DIR")
    if not folder or not Path(folder).is_dir():
        pytest.skip("DPLIT_DATA_DIR is not set to the shared data folder (GLUE SST-2 + GPT-2 tokenizer)")
    return Path(folder)


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct read once from its GGUF file by dplit's own loaders, saved as a plain HF folder.

    Reading the GGUF file (model and tokenizer) costs ~20 s on a CPU core, so it is read here once and every test
    of the real model takes this folder; the data tests read the real file's tokenizer, and
    ``tests/backbone/test_gguf.py`` takes a tiny GGUF file through ``dplit fit``.
    """
    from dplit.backbone.causal_lm import build_causal_lm
    from dplit.data.tokenizer import load_tokenizer
    from dplit.release.export import forget_gguf_quantizer

    gguf = _shared_data() / "smollm2-135m-instruct" / SMOLLM2_GGUF
    if not gguf.is_file():
        pytest.skip(f"{gguf} is not in the shared data folder")
    model = build_causal_lm(
        pretrained=str(gguf.parent), gguf_file=gguf.name, config=None, vocab_size=None, dropout=None,
        attn_implementation="eager",
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("smollm2-135m-instruct")
    forget_gguf_quantizer(model)  # its weights are plain float32 tensors, as dplit export writes them
    model.save_pretrained(folder)
    load_tokenizer(gguf.parent, gguf.name).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer saved as GPT-2's ``vocab.json`` + ``merges.txt`` (no download).

    Trained so that the default label words of SST-2, QNLI and QQP (and the SmolLM2 configs') are single tokens.
    """
    corpus = [
        "Question: Is the movie great or terrible? Sentence: It was a great movie. "
        "Does the sentence answer the question? yes no",
        "Question 1: How do I learn? Question 2: How can I learn? Same question? yes no It was terrible.",
        "Review: a great movie.\nSentiment: positive negative",
    ] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    folder = tmp_path_factory.mktemp("tiny-bpe")
    bpe.save_model(str(folder))
    return folder


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the files with the most ``slow`` tests first, each file's tests in their own order.

    Under pyproject's ``-n auto --dist loadfile --no-loadscope-reorder`` each worker takes whole files in this order:
    the long files then start early and the many short ones fill the end, instead of the slowest files running alone
    while the other worker idles (xdist's own order, most tests first, put the few-but-long multi-process and real-model
    files last). Without xdist only the order of the files changes.
    """
    slow: dict[Path, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + bool(item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: files with as many slow tests keep their order
