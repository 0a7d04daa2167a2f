"""Training: engines (local, FSDP2, DeepSpeed, tp), the parallel core, and the update loop the roles share.
"""
