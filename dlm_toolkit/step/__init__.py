"""The decode step's public types and mechanics: state, facts, flags, segments, canvas, sampling,
rng, capture, trajectory, and what rules and hooks read (``context``: ``StepContext``,
``Selection``; ``outputs``: ``Output``, ``HookOutputs``). A leaf below the rules API
(``strategy``), the hooks and the loop (``decoding``): nothing here imports them, so the arrows
point one way."""
