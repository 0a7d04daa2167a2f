"""The daemon side of the tensor plane: a per-daemon tensor store, transfer backends, and the
conversion between endpoint values (tensors, Batches) and wire handles.

Everything here imports torch and runs inside daemons; the controller never imports it.
"""
