"""Benchmarks that print comparable figures, each beside a reference measured in the same run.

May import everything; nothing at run time imports bench (bench is not a runtime dependency).
"""
