"""Reliability harnesses: the soak and chaos soak, a stub killed under load, a poisoned load."""
