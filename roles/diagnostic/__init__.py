"""Diagnostic daemons with no model: echo (runtime behaviour) and probe (tensor plane).
Imports hfrt.daemon and hfrt.wire only.
"""
