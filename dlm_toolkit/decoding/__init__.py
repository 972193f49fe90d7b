"""Decoding: the loop on top of the step, the rules and the hooks.

``policy.py`` (:class:`DecodingPolicy`: rules and hooks composed), ``loop.py`` (:func:`decode`),
``engine.py`` (the forward, KV cache, the one host read), ``rule_capture.py`` (compiled rules).
These import ``step``, ``strategy`` and ``hooks``; none of those imports this package, so the
arrows point one way. The old paths (``dlm_toolkit.step.loop``, ``dlm_toolkit.strategy.policy``,
...) warn and forward here (``dlm_toolkit/_aliases.py``).
"""
