"""What both sides share — channels, endpoint declarations, shared-memory names, errors, update
options, Hugging Face Hub model ids.

Imports protocols and the stdlib only (hub.py: huggingface_hub, when an id is resolved): nothing
from control/, daemon/ or torch.
"""
