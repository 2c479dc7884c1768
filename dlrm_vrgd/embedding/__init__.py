"""Embedding tables whose updates are deferred to one step per global batch."""
