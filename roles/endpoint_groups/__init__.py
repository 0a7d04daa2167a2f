"""Endpoint groups: endpoints several role daemons share, mixed into their daemon classes (the
daemon supplies the hooks and public attributes each group's docstring names) — agent turns
(`AgentTurns`, on the actor and the rollout role, with the context checks of `turn_limits`) and
partial rollouts (`PartialRollouts`, on the rollout role). Imports hfrt.daemon, hfrt.wire and
roles/ helpers; never the controller side."""
