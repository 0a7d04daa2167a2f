"""What both sides share — channels, endpoint declarations, shared-memory names, errors, update options.

Imports protocols and the stdlib only: nothing from control/, daemon/ or torch.
"""
