"""The target's own continuation, corrupted at a set rate: measures the engine (`drafttrain bench`)."""
