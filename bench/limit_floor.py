"""The compute floor of a GRPO step for `hfrt bench limit`: each stage's arithmetic done alone in
one plain process with the libraries themselves — vLLM's `LLM.generate` (or transformers'
`generate` for the HF engine), one reference forward over the rollout, and the update's forward,
backward and fused AdamW step — on the same model, prompts and shape as hfrt's step, no daemons,
no messages, no handles, no weight push.

It knows torch, vLLM, transformers and the GRPO loss's arithmetic; nothing of hfrt's runtime.
"""

from __future__ import annotations

import time
from typing import Any

from hfrt.bench.vs_trl import Shape, prompt_rows, thread_count


def floor_worker(shape: Shape, engine: str, steps: int, conn: Any) -> None:
    """The floor process: load everything, say ready, then one floor step per "go" from the parent,
    replying {generate_s, reference_s, update_s, tokens, loss, cpu_s} after each."""
    try:
        Floor(shape, engine, conn).run(steps)
    except BaseException as exc:  # the parent reports it
        import traceback

        conn.send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        raise


class Floor:
    """The three stages on plain libraries, one process, every core (shape.threads)."""

    def __init__(self, shape: Shape, engine: str, conn: Any) -> None:
        start = time.perf_counter()
        import torch

        torch.set_num_threads(thread_count(shape))
        torch.manual_seed(shape.seed)
        from hfrt.roles.models import ModelConfig, load_model, load_tokenizer, resolve_model_dir

        self.torch, self.shape, self.engine, self.conn = torch, shape, engine, conn
        self.folder = str(resolve_model_dir(shape.model, shape.seed))
        self.tokenizer = load_tokenizer(self.folder, shape.seed)
        self.pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id)
        self.eos = int(self.tokenizer.eos_token_id)
        self.policy = load_model(ModelConfig(self.folder, "float32", seed=shape.seed))
        self.reference = load_model(ModelConfig(self.folder, "float32", seed=shape.seed)).eval().requires_grad_(False)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=shape.lr, fused=True)
        self.llm = self._vllm() if engine == "vllm" else None
        self.ready_s = time.perf_counter() - start

    def _vllm(self) -> Any:
        """vLLM in this process with the settings hfrt's vLLM engine gives it (fp32, its KV budget)."""
        from hfrt.roles.generation.vllm_engine import VLLMConfig, import_vllm, kv_budget

        vllm = import_vllm()
        cfg = VLLMConfig(model_dir=self.folder, dtype="float32", seed=self.shape.seed)
        return vllm.LLM(model=self.folder, dtype=cfg.dtype, max_model_len=cfg.max_model_len, kv_cache_memory_bytes=kv_budget(cfg),
                        max_num_seqs=cfg.max_num_seqs, enforce_eager=cfg.enforce_eager, seed=cfg.seed, logprobs_mode="processed_logprobs")

    def run(self, steps: int) -> None:
        self.conn.send({"ready_s": self.ready_s})
        rows = prompt_rows(self.shape, steps)
        for step in range(steps):
            if self.conn.recv() != "go":
                return
            lo, hi = step * self.shape.prompts, (step + 1) * self.shape.prompts
            self.conn.send(self.step(rows["prompt"][lo:hi], rows["ground_truth"][lo:hi]))
        self.conn.send({"done": True})

    # ------------------------------------------------------------------------------ one step
    def step(self, prompts: list[str], truths: list[str]) -> dict[str, Any]:
        cpu0 = time.process_time()  # this process's CPU seconds, every thread: steadier than wall time on a shared machine
        t0 = time.perf_counter()
        prompt_ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        responses = self.generate(prompt_ids)
        t1 = time.perf_counter()
        batch = self.layout([ids for ids in prompt_ids for _ in range(self.shape.n)], responses)
        advantages = self.advantages(responses, truths)
        with self.torch.no_grad():
            ref = self.log_probs(self.reference, batch)
        t2 = time.perf_counter()
        loss = self.update(batch, ref, advantages)
        t3 = time.perf_counter()
        tokens = sum(len(r) for r in responses)
        return {"generate_s": t1 - t0, "reference_s": t2 - t1, "update_s": t3 - t2, "tokens": tokens, "loss": loss,
                "cpu_s": time.process_time() - cpu0}

    def generate(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """n samples per prompt, temperature 1, up to max_new_tokens each (ending at EOS, included)."""
        n, new = self.shape.n, self.shape.max_new_tokens
        if self.llm is not None:
            from vllm import SamplingParams

            params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=new, logprobs=0)
            outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
            return [list(c.token_ids) for o in outs for c in o.outputs]
        torch = self.torch
        width = max(len(ids) for ids in prompt_ids)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompt_ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        with torch.no_grad():
            out = self.policy.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                       max_new_tokens=new, num_return_sequences=n, pad_token_id=self.pad)
        rows = []
        for row in out[:, width:].tolist():
            cut = row.index(self.eos) + 1 if self.eos in row else len(row)
            rows.append(row[:cut])
        return rows

    def layout(self, prompts: list[list[int]], responses: list[list[int]]) -> dict[str, Any]:
        """Prompts left-padded to the longest, responses right-padded to the longest (hfrt's rollout layout)."""
        torch = self.torch
        p_w, r_w = max(len(p) for p in prompts), max(max(len(r) for r in responses), 1)
        ids = [[self.pad] * (p_w - len(p)) + p + r + [self.pad] * (r_w - len(r)) for p, r in zip(prompts, responses, strict=True)]
        mask = [[0] * (p_w - len(p)) + [1] * (len(p) + len(r)) + [0] * (r_w - len(r)) for p, r in zip(prompts, responses, strict=True)]
        input_ids, attention = torch.tensor(ids), torch.tensor(mask)
        return {"input_ids": input_ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                "prompt_width": p_w, "response_mask": attention[:, p_w:].float()}

    def log_probs(self, model: Any, batch: dict[str, Any]) -> Any:
        """Log-probs of the response tokens: the decoder over every position, the LM head only at
        the positions that predict a response token."""
        p_w = batch["prompt_width"]
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).last_hidden_state
        logits = model.lm_head(hidden[:, p_w - 1:-1]).float()
        targets = batch["input_ids"][:, p_w:]
        return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def advantages(self, responses: list[list[int]], truths: list[str]) -> Any:
        """The addition reward less the group's mean (not divided by its std), one per row."""
        from hfrt.flows.tasks import addition_reward

        n = self.shape.n
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        rewards = self.torch.tensor([addition_reward(t, truths[i // n]) for i, t in enumerate(texts)]).view(-1, n)
        return (rewards - rewards.mean(-1, keepdim=True)).view(-1)

    def update(self, batch: dict[str, Any], ref: Any, advantages: Any) -> float:
        """Token-mean policy-gradient loss with k3 KL to the reference (coefficient 0.001), one
        forward and backward over every row, grad-norm clip 1.0, one fused AdamW step."""
        mask = batch["response_mask"]
        logp = self.log_probs(self.policy, batch)
        ratio = (logp - logp.detach()).exp()
        kl = (ref - logp).exp() - (ref - logp) - 1.0
        per_token = -advantages.unsqueeze(-1) * ratio + 0.001 * kl
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

