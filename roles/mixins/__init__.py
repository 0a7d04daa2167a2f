"""Endpoint groups several role daemons share (advantages, agent turns, partial rollouts, weight sync), mixed into their classes.
"""
