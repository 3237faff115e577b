"""Files made from what the agent knows: one module per format."""
