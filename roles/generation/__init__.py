"""Generation engines (built-in HF, vLLM), the actor's hybrid engine, and the rows between prompts and an engine.
Imports hfrt.daemon, torch, transformers, (lazily) vllm, and the parallel layouts of roles/training.
"""
