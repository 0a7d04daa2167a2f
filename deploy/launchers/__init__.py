"""Launchers: the launcher interface and the local, SSH and Slurm launchers that start daemons.
"""
