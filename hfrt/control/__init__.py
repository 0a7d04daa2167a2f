"""The controller side: registry, role groups, dispatch, futures, liveness, trace, recovery as a call layer.

Imports wire/ and protocols; never torch (fetch imports it lazily, on purpose), never daemon/ or roles.
"""
