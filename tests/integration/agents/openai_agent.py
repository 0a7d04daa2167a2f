"""A tiny agent program as a user writes one, for `agent_command` (tests/integration/test_agent_command.py):
the `openai` client pointed at hfrt's endpoint by OPENAI_BASE_URL / OPENAI_API_KEY, the conversation's
session id sent as the X-Session-Id header, two chat turns, then its reward on the last line of stdout.
Conversation I of a step (session "stepS-I"): I % 4 == 0 fails after its first call (exit 3),
I % 4 == 1 ends on a line that is no number (the flow's agent_reward scores it), the others state a
reward, 1.0 when the reply's length is even (a signal a random tiny model's replies vary on)."""

import os
import sys

from openai import OpenAI

client = OpenAI(default_headers={"X-Session-Id": os.environ["HFRT_SESSION_ID"]}, max_retries=0)
index = int(os.environ["HFRT_SESSION_ID"].rsplit("-", 1)[1])
messages = [{"role": "user", "content": os.environ["HFRT_PROMPT"]}]
for turn in range(2):
    reply = client.chat.completions.create(model=os.environ["HFRT_MODEL"], messages=messages,
                                           max_tokens=int(os.environ["HFRT_MAX_TOKENS"]),
                                           temperature=float(os.environ["HFRT_TEMPERATURE"]))
    text = reply.choices[0].message.content or ""
    print(f"turn {turn}: {text!r}")
    if index % 4 == 0:
        print("giving up", file=sys.stderr)
        sys.exit(3)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
print("the answer is above" if index % 4 == 1 else float(len(text) % 2 == 0))
