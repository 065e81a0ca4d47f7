"""DP-SGD in plain PyTorch, without Lightning.

The mechanism (dpsgd.py), clipping/, accounting/, and the records that follow the weights (history, ledger, integrity).
"""
