"""Where configs and checkpoints written before issue 33 name the embedding policies: :mod:`dplit.backbone.embeddings`."""

from dplit.backbone.embeddings import EmbeddingPolicy, TiedEmbeddings, UntiedEmbeddings

__all__ = ["EmbeddingPolicy", "TiedEmbeddings", "UntiedEmbeddings"]
