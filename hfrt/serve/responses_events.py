"""The response side of `POST /v1/responses`: a sampled chat turn as a Response object (a
`message` output item with its `output_text`, one `function_call` item per parsed tool call,
usage, `status` "incomplete" with `incomplete_details` when max_output_tokens cut it) and as the
server-sent events the OpenAI SDKs parse (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ..., `response.completed`
or `response.incomplete`), with hfrt's token-in/token-out extension fields (`prompt_token_ids`,
`token_ids`, `weight_version`).

Pure logic: it knows the Responses shapes and the chat reply they are made from; nothing of HTTP,
sampling or sessions. Tokens are named `token_id:ID` in logprobs (the server holds no tokenizer).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from hfrt.serve.responses import TurnResult, token_name
from hfrt.serve.responses_api import ResponsesTurn


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def text_logprobs(result: TurnResult, start: int = 0, stop: int | None = None) -> list[dict[str, Any]]:
    """Responses' logprobs of the sampled tokens start..stop, with their top alternatives."""
    top = result.top
    return [{"token": token_name(t), "logprob": result.log_probs[start + i], "bytes": [],
             "top_logprobs": [{"token": token_name(a), "logprob": lp, "bytes": []} for a, lp in (top[start + i] if start + i < len(top) else [])]}
            for i, t in enumerate(result.token_ids[start:stop])]


def output_items(message: dict[str, Any], logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The chat reply as returned (content, tool_calls) as Responses output items."""
    items: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append({"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": [],
                                   "logprobs": logprobs or []}]})
    for call in calls:
        items.append({"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


class ResponseShape:
    """One response's id, creation time and the fields every form of it shares."""

    def __init__(self, rt: ResponsesTurn, model: str, created: int) -> None:
        self.rt, self.model, self.created, self.id = rt, model, created, _id("resp")

    def body(self, status: str, output: list[dict[str, Any]], result: TurnResult | None = None) -> dict[str, Any]:
        """The Response object in `status` with `output` (and, once sampled, usage and the extension fields)."""
        body: dict[str, Any] = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                                "output": output, "error": None, "incomplete_details": None, "usage": None, "reasoning": None,
                                "service_tier": "default", **self.rt.echo}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if result is not None:
            n_in, n_out = len(result.prompt_ids), len(result.token_ids)
            body["usage"] = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens": n_out,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}
            body |= {"prompt_token_ids": result.prompt_ids, "token_ids": result.token_ids, "weight_version": result.weight_version}
        return body

    def final(self, result: TurnResult, message: dict[str, Any], finish_reason: str) -> dict[str, Any]:
        """The whole Response of a sampled turn (its chat reply `message` and finish reason)."""
        logprobs = text_logprobs(result) if self.rt.logprobs else None
        status = "incomplete" if finish_reason == "length" else "completed"
        return self.body(status, output_items(message, logprobs), result)


class ResponseEvents:
    """The events of one streamed response, numbered in order (`sequence_number`)."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape, self.seq = shape, 0
        self.text_item: dict[str, Any] | None = None
        self.text = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()

    def start(self) -> Iterator[bytes]:
        """response.created and response.in_progress."""
        body = self.shape.body("in_progress", [])
        yield self.event("response.created", response=body)
        yield self.event("response.in_progress", response=body)

    def text_delta(self, delta: str, logprobs: list[dict[str, Any]]) -> Iterator[bytes]:
        """A piece of the message's text as it is sampled (the message item opened on the first)."""
        if self.text_item is None:
            self.text_item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant", "content": []}
            yield self.event("response.output_item.added", output_index=0, item=self.text_item)
            yield self.event("response.content_part.added", item_id=self.text_item["id"], output_index=0, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self.text += delta
        yield self.event("response.output_text.delta", item_id=self.text_item["id"], output_index=0, content_index=0, delta=delta,
                         logprobs=logprobs)

    def finish(self, final: dict[str, Any]) -> Iterator[bytes]:
        """Every output item's closing events (the items not streamed yet, whole), then
        response.completed (or response.incomplete)."""
        output = []
        for index, item in enumerate(final["output"]):
            if item["type"] == "message" and self.text_item is not None and index == 0:
                item = {**item, "id": self.text_item["id"]}
                yield from self._close_text(item)
            elif item["type"] == "message":
                yield from self._whole_text(index, item)
            else:
                yield from self._call(index, item)
            output.append(item)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield self.event(kind, response={**final, "output": output})

    def _close_text(self, item: dict[str, Any]) -> Iterator[bytes]:
        part = item["content"][0]
        yield self.event("response.output_text.done", item_id=item["id"], output_index=0, content_index=0, text=part["text"],
                         logprobs=part["logprobs"])
        yield self.event("response.content_part.done", item_id=item["id"], output_index=0, content_index=0, part=part)
        yield self.event("response.output_item.done", output_index=0, item=item)

    def _whole_text(self, index: int, item: dict[str, Any]) -> Iterator[bytes]:
        part = item["content"][0]
        yield self.event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
        yield self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                         part={**part, "text": ""})
        yield self.event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0, delta=part["text"],
                         logprobs=part["logprobs"])
        yield self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                         logprobs=part["logprobs"])
        yield self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        yield self.event("response.output_item.done", output_index=index, item=item)

    def _call(self, index: int, item: dict[str, Any]) -> Iterator[bytes]:
        yield self.event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"})
        yield self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
        yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"],
                         arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=index, item=item)

    def error(self, body: dict[str, Any]) -> bytes:
        """A failure after the events began: an `error` event (OpenAI's shape of one)."""
        err = body.get("error", {})
        return self.event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
