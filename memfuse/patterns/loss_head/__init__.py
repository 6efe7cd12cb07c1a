"""The loss head: linear + cross-entropy found in a model and computed in chunks."""
