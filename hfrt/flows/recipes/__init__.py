"""Built-in recipes, one algorithm each. A recipe imports machinery from hfrt.flows and
hfrt.flows.agent, never a sibling recipe; an RL recipe's STAGES (read by `hfrt plan`) is checked
against the calls one of its steps really makes by tests/flows/test_flow_stages.py.
"""
