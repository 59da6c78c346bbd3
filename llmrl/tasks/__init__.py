"""Problem sets below the agent layer, shared by the tiny model and the environments."""
