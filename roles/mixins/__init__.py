"""What several role daemons share around their endpoints: endpoint groups mixed into a daemon
with hooks it implements (agent turns, partial rollouts), and components a daemon holds behind
endpoints it declares itself (advantages, weight sync). Imports hfrt.daemon, hfrt.wire and
roles/ helpers; never the controller side."""
