"""Programs' front doors onto the engine."""
