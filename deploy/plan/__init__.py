"""`hfrt plan`: the HybridFlow paper's Algorithm 1 (auto device mapping) — cost model, search, PLAN.toml, spec writing, calibration.
"""
