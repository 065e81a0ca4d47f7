"""The causal language model under every task: loading it, its tied or untied embeddings, its peft adapters."""
