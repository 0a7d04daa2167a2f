"""Launchers: the launcher interface and the local, SSH and Slurm launchers that start daemons.
Imports protocols, hfrt.wire.shm and hfrt.log; never the controller.
"""
