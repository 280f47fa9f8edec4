"""Framework integrations. Each module imports its framework; import the one you use."""
