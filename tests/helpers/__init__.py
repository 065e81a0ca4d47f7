"""Code the tests share: tiny models and data, reference computations, command lines."""
