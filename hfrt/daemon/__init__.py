"""The daemon side: the Daemon base class, its serving loop, heartbeats, the tensor store and plane, batches.

Imports wire/, protocols and torch; nothing from control/ or flows/.
"""
