"""The LightningModules dplit trains: a shared base and its two tasks (a classifier and a language model)."""
