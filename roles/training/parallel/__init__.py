"""3D parallelism for the actor: layouts (pp, dp, tp), per-parameter shard rules, TP/PP model
pieces, and the resharding between a training layout and a generation layout."""
