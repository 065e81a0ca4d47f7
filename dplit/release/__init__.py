"""What leaves a dplit run: a Hugging Face export with its privacy guarantee, and DP synthetic text."""
