"""Built-in recipes, one algorithm each. A recipe imports machinery from hfrt.flows and hfrt.flows.agent.loop, never a sibling recipe.
"""
