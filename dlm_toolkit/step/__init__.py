"""The decode step: the loop, the engine (forward), the canvas, state, sampling and capture."""
