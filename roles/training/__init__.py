"""Training: engines (local, FSDP2, DeepSpeed, tp), the parallel core, and the update loop the roles share.
Imports torch, hfrt.daemon and hfrt.wire (the reshard also the generation side's layouts); never the controller side.
"""
